"""One request's life in the k3 cache, shared by the server and the trace replay.

The server's cache (:mod:`sglang_k3.integration.k3_cache`) translates SGLang's calls into these
verbs; the replay's ``k3`` policy (``benchmarks/policies/k3.py``) calls the same verbs in simulated
time. Both build this object with :func:`~sglang_k3.cache.build.build_lifecycle` from the same
:class:`~sglang_k3.config.K3Config`, so what the replay measures is what the server runs.

The life of one request, in the order the verbs are called::

    match(admit=True)      find the branch point, two-phase lookup, pin the hit (invariant 1)
    store.restore          (host) copy-on-write of the hit into the request's private slot
    release_pin            the copy has landed (the request's first forward ran)
    insert                 the request's KV joins the tree (chunk end, prompt end, decode, finish)
    store_exports          keep chunk-boundary states the extend exported (prompt end, branch point)
    checkpoint_running     fork the live state at a chunk end / prompt end / decode interval
    finish                 donate (or store) the final state at the generation end
    release                forget the request's match-time data

Everything here is ints and handles: no torch. State memory is reached only through a
:class:`~sglang_k3.cache.ports.CheckpointStore` (the fp32 mamba-slot store, the quantized checkpoint pool, the replay's
simulated pool; a host-memory store would be one more), KV frees through a callback.

Ready flags (invariant 2): a checkpoint enters the tree not ready and is marked ready when its
write has been issued (``_land``). Stores run at once, or, inside a store scope
(:meth:`begin_store_scope`, one per scheduler step) with a store that batches, are queued as
:class:`QueuedStore` records and run in one call when the scope closes (:meth:`flush_stores`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from sglang_k3.cache.actions import ActionExecutor, Freed
from sglang_k3.cache.eviction_verbs import EvictionVerbs
from sglang_k3.cache.ghosts import ReuseLearner
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.placement import PlacementPolicy
from sglang_k3.cache.ports import CheckpointStore, ExportSource, TierPort
from sglang_k3.cache.results import InsertResult, MatchResult, Pin
from sglang_k3.cache.tier_bridge import TierBridge
from sglang_k3.cache.tree import K3RadixTree


@dataclass
class RequestRecord:
    """What the cache remembers of one admitted request between its match and its release."""

    rid: str
    prompt_len: Optional[int]
    is_done: Callable[[], bool]  # the host's view: a request aborted while waiting is done
    branch_point: Optional[int] = None
    pin: Optional[Pin] = None  # held until the request's copy-on-write has landed
    repeat: bool = False  # its whole prompt was already cached: a regenerated or repeated prompt
    placed: list[Checkpoint] = field(default_factory=list)  # checkpoints it put in the tree
    restored: Optional[Checkpoint] = None  # the checkpoint its hit restored from
    # Its key, kept from a match that found no branch point until its first forward is planned
    # (:meth:`CacheLifecycle.export_plan`): another request's path may have joined the tree since.
    unplanned_key: Optional[Sequence[int]] = field(default=None, repr=False)


@dataclass
class QueuedStore:
    """A checkpoint whose store waits for the end of the step: in the tree, not ready."""

    node: Node
    checkpoint: Checkpoint
    active_slot: int
    handle: int
    release_active: bool  # the request finished: its active slot goes back after the store


def _never_done() -> bool:
    return False


@dataclass
class LifecycleCounters:
    store_flushes: int = 0  # flush_stores calls that stored something
    stores_flushed: int = 0  # checkpoints stored by them
    stale_state_skips: int = 0  # live-slot copies not made: the slot had moved past the boundary
    unkeyed_state_skips: int = 0  # live states not stored: the boundary ends inside a KV page


class CacheLifecycle(EvictionVerbs):
    def __init__(
        self,
        tree: K3RadixTree,
        placement: PlacementPolicy,
        store: CheckpointStore,
        free_kv: Callable[[list[int]], None],
        tiers: Optional[TierPort] = None,
        alloc_kv: Optional[Callable[[int], Optional[list[int]]]] = None,
        park_every: int = 0,
    ) -> None:
        self.tree = tree
        self.placement = placement
        self.store = store
        self._free_kv = free_kv
        # Lower tiers (host, Mooncake): evicted boundaries go down, admitted requests bring the
        # deepest one back up, through the bridge (sglang_k3.cache.tier_bridge). alloc_kv gives KV
        # slots for the KV that comes up (None when there is no room, even after evicting).
        if tiers is not None and alloc_kv is None:
            raise ValueError("lower tiers need alloc_kv to bring KV back to the device")
        self.tiers = tiers
        self.bridge: Optional[TierBridge] = None
        # With a lower tier, evictions hand back a SaveBoundary for the executor to demote.
        tree.capture_evicted = tiers is not None
        if tiers is not None:
            self.bridge = TierBridge(tree, store, tiers, alloc_kv, free_kv, self.insert, park_every)  # type: ignore[arg-type]
        self.executor = ActionExecutor(store.free, free_kv, self.bridge.save_boundaries if self.bridge else None)
        self.requests: dict[str, RequestRecord] = {}
        self._prune_at = 64
        self._store_scope = 0
        self._queue: list[QueuedStore] = []
        self.counters = LifecycleCounters()

    # ------------------------------------------------------------------ match
    def match(
        self,
        rid: Optional[str],
        tokens: Sequence[int],
        *,
        admit: bool,
        prompt_len: Optional[int] = None,
        is_done: Callable[[], bool] = _never_done,
        tier_room: Optional[int] = None,
    ) -> MatchResult:
        """Look ``tokens`` up. With ``admit`` (the request is about to be scheduled and will copy
        the hit) the request is recorded, its branch point found and the hit pinned; a re-match
        replaces the previous record's pin. Without it, a read-only lookup (sorting, probing).
        ``tier_room``: at most this many KV tokens may be brought up from a lower tier for it (the
        caller's free memory not yet promised to other requests; None: no limit)."""
        if admit and rid is not None:
            rec = self.requests.get(rid)
            if rec is not None:
                self.release_pin(rid)
            rec = RequestRecord(rid, prompt_len, is_done)
            self.requests[rid] = rec
            if len(self.requests) > self._prune_at:  # amortized: O(1) per match
                self.forget_done()
                self._prune_at = 2 * len(self.requests) + 64
            if self.placement.at_branch_points:
                rec.branch_point = self.tree.find_branch_point(tokens) or None
                rec.unplanned_key = tokens if rec.branch_point is None else None
            if self.bridge is not None:
                self.bridge.forget(rid)
                self.bridge.promote(tokens, tier_room)  # admission promotes first, then matches
        elif self.bridge is not None:
            self.bridge.prefetch(tokens)  # a read-only lookup of a waiting request (e.g. sorting)
        res = self.tree.match_prefix(tokens, pin=admit and rid is not None)
        if admit and rid is not None:
            rec = self.requests[rid]
            rec.pin = res.pin
            rec.restored = res.checkpoint
            rec.repeat = res.mla_len >= len(tokens) > 0
            bridge = self.bridge
            if res.checkpoint is not None and res.checkpoint.hits == 1 and bridge and bridge.saves_at_first_hit:
                bridge.save(res.checkpoint)
        return res

    def prefetch(self, tokens: Sequence[int]) -> None:
        """A waiting request was looked at (refreshed or sorted): with lower tiers, start copying
        its deepest boundary up to host memory (:meth:`TierBridge.prefetch
        <sglang_k3.cache.tier_bridge.TierBridge.prefetch>`)."""
        if self.bridge is not None:
            self.bridge.prefetch(tokens)

    def held_for_tiers(self, rid: str, tokens) -> bool:
        """Whether the waiting request should wait before its admission: its boundary is being
        copied up from a tier below host memory (:meth:`TierBridge.held
        <sglang_k3.cache.tier_bridge.TierBridge.held>`: ``tokens``, or a callable giving them).
        False without lower tiers."""
        return self.bridge is not None and self.bridge.held(rid, tokens)

    def wait_for_tiers(self) -> None:
        """Only held requests wait and nothing runs: wait briefly for a copy up to land
        (:meth:`TierBridge.wait_held <sglang_k3.cache.tier_bridge.TierBridge.wait_held>`)."""
        if self.bridge is not None:
            self.bridge.wait_held()

    def release_pin(self, rid: str) -> None:
        """The request's copy-on-write has landed (or will never run): its checkpoint may go."""
        self.store.cancel_restore(rid)  # a restore not run by now is not wanted any more
        rec = self.requests.get(rid)
        if rec is not None and rec.pin is not None:
            pin, rec.pin = rec.pin, None
            self.tree.release_pin(pin)

    def release(self, rid: str) -> None:
        """The request is gone: drop its pin and match-time data."""
        self.release_pin(rid)
        self.requests.pop(rid, None)
        if self.bridge is not None:
            self.bridge.forget(rid)

    def forget_done(self) -> int:
        """Release requests the host reports done that never reached :meth:`release` (a request
        aborted while waiting). Call between scheduler steps only, never while a finishing
        request is being checkpointed. Returns how many were forgotten."""
        done = [rid for rid, rec in self.requests.items() if rec.is_done()]
        for rid in done:
            self.release(rid)
        return len(done)

    def _release_done_pins(self) -> None:
        """Before evicting: pins of done requests are dropped so their checkpoints may go (the
        records stay until :meth:`forget_done`, since a finishing request may still be
        checkpointed in this step)."""
        for rid, rec in list(self.requests.items()):
            if rec.pin is not None and rec.is_done():
                self.release_pin(rid)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], kv: Sequence[int], ragged: bool = False) -> InsertResult:
        """Insert a request's KV; indices the tree already held under other slots are freed.
        ``ragged``: the request is done writing its last KV page, so the tree may keep it partial
        (with pages over one token, a generation end inside a page keeps its exact state)."""
        ins = self.tree.insert(tokens, kv, ragged=ragged)
        if ins.duplicate_kv:
            self._free_kv(ins.duplicate_kv)
        return ins

    # ------------------------------------------------------------------ checkpoints while running
    def export_plan(self, rid: Optional[str], grid: Sequence[int], end: int) -> list[int]:
        """Which exported grid positions of ``rid``'s extend the cache may store (asked when the
        forward begins, so only those rows are kept)."""
        rec = self.requests.get(rid) if rid is not None else None
        if rec is not None and rec.unplanned_key is not None:
            # Requests admitted together, or (overlap scheduler) admitted before an earlier
            # prefill's results were processed, matched a tree without each other's paths; by
            # their forward those paths may be in: look for the fork again, once.
            rec.branch_point = self.tree.find_branch_point(rec.unplanned_key) or None
            rec.unplanned_key = None
        wanted = list(
            self.placement.export_candidates(
                grid, end, rec.prompt_len if rec else None, rec.branch_point if rec else None
            )
        )
        if self.bridge is not None:
            wanted += self.bridge.park_positions(grid, wanted)
        return wanted

    def store_exports(self, rid: str, node: Node, end: int, source: ExportSource) -> None:
        """Keep the exported states :meth:`export_plan` wanted: the last grid point before the
        prompt end (a repeated or contained prompt still hits) and the one at or below the
        branch point (requests sharing only that prefix hit)."""
        rec = self.requests.get(rid)
        wanted = self.placement.export_candidates(
            source.grid(), end, rec.prompt_len if rec else None, rec.branch_point if rec else None
        )
        if (
            rec is not None
            and self.placement.at_branch_points
            and not any(k & CheckpointKind.BRANCH for k in wanted.values())
        ):
            self.tree.keep_as_branch_state(rec.restored, rec.branch_point)
        for pos, kind in sorted(wanted.items()):
            if pos > node.end:  # inside the running request's last KV page: not in the tree yet
                self.counters.unkeyed_state_skips += 1
                continue
            if self.has_checkpoint_at(node, pos) or not source.kept(pos):
                continue
            handle = self._pinned(node, self.store.capture_export, source, pos)
            if handle is None:
                return  # no memory for it now
            self._register(node, pos, handle, kind, rid)
        if self.bridge is not None and self.bridge.park_every:
            self.bridge.park(
                node, source, wanted, lambda src, pos: self._pinned(node, self.store.capture_export, src, pos)
            )

    def running_kind(self, rid: str, up_to: int) -> Optional[CheckpointKind]:
        rec = self.requests.get(rid)
        prompt_len = rec.prompt_len if rec is not None and rec.prompt_len is not None else up_to
        if up_to >= prompt_len:
            return CheckpointKind.PROMPT_END if self.placement.at_prompt_end else None
        return CheckpointKind.CHUNK if self.placement.at_chunk_end else None

    def checkpoint_running(
        self,
        rid: str,
        node: Node,
        up_to: int,
        active_slot: int,
        kind: Optional[CheckpointKind] = None,
        state_len: Optional[int] = None,
    ) -> None:
        """Fork the running request's state at ``up_to`` (its KV is inserted up to ``node``).

        ``state_len`` is how many tokens the active slot holds where the copy would land (None:
        exactly ``up_to``). Under an overlap scheduler the next step may already have advanced the
        slot past ``up_to`` (a prompt end whose first decode token is in flight); its state then
        belongs to no boundary of this key, and nothing is stored (counted in ``stale_state_skips``)."""
        kind = kind or self.running_kind(rid, up_to)
        if kind is None or self.has_checkpoint_at(node, up_to):
            return
        if state_len is not None and state_len != up_to:
            self.counters.stale_state_skips += 1
            return
        if self._queues_stores():
            self._queue_store(node, up_to, kind, active_slot, release_active=False, rid=rid)
            return
        handle = self._pinned(node, self.store.capture_active, active_slot)
        if handle is None:
            return  # no memory for a checkpoint now: the request goes on, the boundary is not cached
        self._register(node, up_to, handle, kind, rid)

    def decode_due(self, seq_len: int, advanced: int = 1) -> bool:
        return self.placement.decode_checkpoint(seq_len, advanced)

    # ------------------------------------------------------------------ finish
    def finish(self, node: Node, up_to: int, state_len: int, active_slot: int, rid: Optional[str] = None) -> None:
        """The request finished with its KV inserted up to ``node`` (``up_to`` tokens) and its
        active slot holding the state after ``state_len`` tokens. The slot is consumed: donated
        to the tree, queued for a store that releases it, or released. With ``rid``, the states
        the request placed earlier that the generation-end state supersedes then leave the tree
        (:meth:`_drop_superseded`)."""
        self._donate_final(node, up_to, state_len, active_slot)
        if rid is not None and self.placement.drop_superseded:
            self._drop_superseded(rid, node, up_to)

    def _donate_final(self, node: Node, up_to: int, state_len: int, active_slot: int) -> None:
        donate = (
            self.placement.at_generation_end
            and up_to == state_len  # the slot's state is exactly at up_to
            and not self.has_checkpoint_at(node, up_to)
        )
        if not donate:
            self.store.release_active(active_slot)
            return
        if self._queues_stores():
            self._queue_store(node, up_to, CheckpointKind.GEN_END, active_slot, release_active=True)
            return
        handle = self._pinned(node, self.store.donate, active_slot)
        if handle != active_slot or not self.store.shares_active_slots:
            self.store.release_active(active_slot)
        if handle is not None:
            self._register(node, up_to, handle, CheckpointKind.GEN_END)

    def _drop_superseded(self, rid: str, node: Node, up_to: int) -> None:
        """One state per turn (:meth:`~sglang_k3.cache.retention.Retention.drop_superseded`): once
        the request's generation-end state is in the tree, the states it placed earlier go, but
        for those with evidence of forks."""
        rec = self.requests.get(rid)
        if rec is None or not self.has_checkpoint_at(node, up_to):
            return  # no state at the generation end: nothing supersedes the earlier ones
        freed = self.tree.drop_superseded(
            rec.placed, rec.restored, up_to, rec.repeat, rec.prompt_len, self.placement.keep_repeat_state
        )
        rec.placed = [ck for ck in rec.placed if ck.node is not None]
        self._apply(freed)

    # ------------------------------------------------------------------ one store call per step
    def begin_store_scope(self) -> None:
        self._store_scope += 1

    def end_store_scope(self) -> None:
        self._store_scope -= 1
        if self._store_scope == 0:
            self.flush_stores()

    def _queues_stores(self) -> bool:
        return self._store_scope > 0 and self.store.batches_stores

    def _queue_store(
        self,
        node: Node,
        pos: int,
        kind: CheckpointKind,
        active: int,
        release_active: bool,
        rid: Optional[str] = None,
    ) -> None:
        handle = self._pinned(node, self.store.alloc)
        ck = None if handle is None else self._add_pending(node, pos, handle, kind)
        if ck is None:  # no memory for it now, or the boundary is already there
            if release_active:
                self.store.release_active(active)
            return
        self._note_placed(rid, ck)
        self._queue.append(QueuedStore(node, ck, active, handle, release_active))  # type: ignore[arg-type]

    def flush_stores(self) -> int:
        """Run the queued stores in one call; a refused (non-finite) state's checkpoint leaves the
        tree. Returns how many were queued."""
        queue, self._queue = self._queue, []
        if not queue:
            return 0
        accepted = self.store.store_many([q.active_slot for q in queue], [q.handle for q in queue])
        self.counters.store_flushes += 1
        for q, ok in zip(queue, accepted):
            if ok:
                self.counters.stores_flushed += 1
                self._land(q.node, q.checkpoint)
            else:
                self.tree.mark_ready(q.checkpoint)  # drop_checkpoint takes landed checkpoints only
                self.tree.drop_checkpoint(q.checkpoint)  # the store already released the handle
            if q.release_active:
                self.store.release_active(q.active_slot)
        return len(queue)

    # ------------------------------------------------------------------ registering
    def has_checkpoint_at(self, node: Node, pos: int) -> bool:
        return any(ck.pos == pos for ck in self.tree.path_checkpoints(node))

    def _pinned(self, node: Node, fn, *args):
        """Run a storing operation (it may allocate and so evict) with the path locked
        (invariant 1: pin before allocating)."""
        self.tree.inc_lock_ref(node)
        try:
            return fn(*args)
        finally:
            self.tree.dec_lock_ref(node)

    def _register(self, node: Node, pos: int, handle: int, kind: CheckpointKind, rid: Optional[str] = None) -> None:
        ck = self._add_pending(node, pos, handle, kind)
        if ck is not None:
            self._note_placed(rid, ck)
            self._land(node, ck)  # the copy (or donation) has been issued

    def _note_placed(self, rid: Optional[str], ck: Checkpoint) -> None:
        rec = self.requests.get(rid) if rid is not None else None
        if rec is not None:
            rec.placed.append(ck)

    def _add_pending(self, node: Node, pos: int, handle: int, kind: CheckpointKind) -> Optional[Checkpoint]:
        """Put ``handle`` in the tree at ``pos``, not ready yet; None (handle freed) if the tree
        already has a checkpoint there."""
        ck = self.tree.add_checkpoint(node, pos, [handle], self.store.slot_bytes, kind=kind, ready=False)
        if ck is None:
            self.store.free([handle])
        return ck

    def _land(self, node: Node, ck: Checkpoint) -> None:
        """``ck``'s write has been issued: make it matchable and apply the path's budget."""
        self.tree.mark_ready(ck)
        if self.bridge is not None and self.bridge.saves_at_landing:
            self.bridge.save(ck)
        attached = node is self.tree.root or node.parent is not None  # not trimmed away meanwhile
        self._apply(self.tree.recycle_path(node if attached else ck.node, self.placement))

    def reset(self) -> Freed:
        """Drop the tree and every request's record. The caller's pools are cleared by the host
        (SGLang clears its allocators after a flush), so nothing is freed here; the returned
        :class:`Freed` says what was held."""
        freed = self.tree.reset()
        self.requests.clear()
        self._queue = []  # its checkpoints went with the tree
        return freed

    def stats(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.tree.stats.as_dict())
        d.update(
            tracked_requests=len(self.requests),
            checkpoint_count=self.tree.checkpoint_count(),
            checkpoint_bytes=self.tree.checkpoint_bytes(),
            kv_tokens=self.tree.total_size(),
            store_flushes=self.counters.store_flushes,
            stores_flushed=self.counters.stores_flushed,
            stale_state_skips=self.counters.stale_state_skips,
            unkeyed_state_skips=self.counters.unkeyed_state_skips,
            tier_errors=self.bridge.counters.tier_errors if self.bridge else 0,
            tier_parked=self.bridge.counters.tier_parked if self.bridge else 0,
            tier_held=self.bridge.counters.tier_held if self.bridge else 0,
            tier_held_seconds=self.bridge.counters.tier_held_seconds if self.bridge else 0.0,
            tier_held_expired=self.bridge.counters.tier_held_expired if self.bridge else 0,
            tier_hold_lookups=self.bridge.counters.tier_hold_lookups if self.bridge else 0,
            tier_hold_waits=self.bridge.counters.tier_hold_waits if self.bridge else 0,
        )
        d.update(self.tree.misses.as_dict())
        d.update((self.tree.reuse or ReuseLearner()).as_dict())
        d.update(self.store.stats())
        if self.tiers is not None:
            d.update(self.tiers.stats())
        return d
