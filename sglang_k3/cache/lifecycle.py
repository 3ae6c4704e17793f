"""One request's life in the k3 cache, shared by the server and the trace replay.

The server's cache (:mod:`sglang_k3.integration.k3_cache`) translates SGLang's calls into these
verbs; the replay's ``k3`` policy (``benchmarks/policies/k3.py``) calls the same verbs in simulated
time. Both build this object with :func:`build_lifecycle` from the same
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
:class:`CheckpointStore` (the fp32 mamba-slot store, the quantized checkpoint pool, the replay's
simulated pool; a host-memory store would be one more), KV frees through a callback.

Ready flags (invariant 2): a checkpoint enters the tree not ready and is marked ready when its
write has been issued (``_land``). Stores run at once, or, inside a store scope
(:meth:`begin_store_scope`, one per scheduler step) with a store that batches, are queued as
:class:`QueuedStore` records and run in one call when the scope closes (:meth:`flush_stores`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from sglang_k3.cache.eviction import EvictionPolicy
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.placement import PlacementPolicy
from sglang_k3.cache.results import DropReason, Freed, FreeKV, InsertResult, MatchResult, Pin, ReleaseCheckpoint
from sglang_k3.cache.tree import K3RadixTree

logger = logging.getLogger(__name__)

# The KDA kernel's chunk: prefills export states at its multiples (the grid k3's restore points
# sit on, besides request ends). The export stash (sglang_k3/state/export_stash.py) reads it.
STATE_GRID = 64


class CheckpointStore(Protocol):
    """Where checkpoints live. Handles are ints the tree holds read-only; active slots are the
    requests' private, writable states. Every method takes and returns ints (no tensors)."""

    dtype: str  # "int8" | "bf16" | "fp32" | ...
    slot_bytes: int  # bytes one checkpoint holds (what the tree and its eviction account)
    shares_active_slots: bool  # checkpoints are slots of the active-state pool (fp32 store)
    batches_stores: bool  # stores may be queued and run in one call (alloc + store_many)

    def alloc(self) -> Optional[int]:
        """A fresh checkpoint handle (evicting through the cache if full), or None."""

    def capture_active(self, active_slot: int) -> Optional[int]:
        """Fork a running request's state: a new checkpoint holding a copy of it."""

    def donate(self, active_slot: int) -> Optional[int]:
        """A finished request's state becomes a checkpoint. A store that shares active slots
        returns ``active_slot`` itself (ownership moves, no copy); others copy into a new handle
        and leave the active slot to :meth:`release_active`."""

    def capture_export(self, source: "ExportSource", pos: int) -> Optional[int]:
        """A chunk-boundary state the extend exported (``source.kept(pos)`` is true)."""

    def store_many(self, active_slots: Sequence[int], handles: Sequence[int]) -> list[bool]:
        """Write each active slot into its allocated handle, in one call; False where refused
        (the store released that handle)."""

    def restore(self, handle: int, rid: str, active_slot: int) -> Optional[int]:
        """Copy-on-write of ``handle`` into the request's private ``active_slot``, deferred to the
        request's next forward. Returns the handle for the host's own copy mechanism to use
        (SGLang's ``mamba_cow_src_index``), or None when the store runs the copy itself."""

    def cancel_restore(self, rid: str) -> None:
        """Forget a deferred restore of ``rid`` that has not run (re-match, abort, release)."""

    def release_active(self, active_slot: int) -> None:
        """Give a request's active slot back to its pool."""

    def free(self, handles: Sequence[int]) -> None:
        """The tree let go of these checkpoints."""

    def stats(self) -> dict[str, int]:
        """The store's own counters (merged into the cache's stats)."""


class ExportSource(Protocol):
    """The states one extend exported for one sequence (host-specific; opaque to the tree)."""

    def grid(self) -> list[int]:
        """Absolute positions with an exported state, ascending."""

    def kept(self, pos: int) -> bool:
        """Whether the state after ``pos`` was kept (only planned rows are)."""


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
    tier_errors: int = 0  # a lower tier raised (logged; the device cache carried on)
    tier_parked: int = 0  # exported states saved straight to the lower tiers (dense states)


class CacheLifecycle:
    def __init__(
        self,
        tree: K3RadixTree,
        placement: PlacementPolicy,
        store: CheckpointStore,
        free_kv: Callable[[list[int]], None],
        tiers: Optional["TierManager"] = None,  # noqa: F821
        alloc_kv: Optional[Callable[[int], Optional[list[int]]]] = None,
        park_every: int = 0,
    ) -> None:
        self.tree = tree
        self.placement = placement
        self.store = store
        self._free_kv = free_kv
        # Lower tiers (host, Mooncake): evicted boundaries go down, admitted requests bring the
        # deepest one back up (sglang_k3.tiers.manager). alloc_kv gives KV slots for the KV that
        # comes up (None when there is no room, even after evicting).
        if tiers is not None and alloc_kv is None:
            raise ValueError("lower tiers need alloc_kv to bring KV back to the device")
        self.tiers = tiers
        self._alloc_kv = alloc_kv
        tree.capture_evicted = tiers is not None
        # Dense states below the device: every ``park_every`` positions of a prefill, the exported
        # state goes straight to the lower tiers (not into the tree), so a later first-time fork
        # inside this prompt restores close to where it forks. 0: off.
        self.park_every = park_every if tiers is not None else 0
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
            if self.tiers is not None:
                self._promote(tokens, tier_room)
        elif self.tiers is not None:
            self.prefetch(tokens)  # a read-only lookup of a waiting request (e.g. sorting)
        res = self.tree.match_prefix(tokens, pin=admit and rid is not None)
        if admit and rid is not None:
            rec = self.requests[rid]
            rec.pin = res.pin
            rec.restored = res.checkpoint
            rec.repeat = res.mla_len >= len(tokens) > 0
            if res.checkpoint is not None and res.checkpoint.hits == 1 and self._saves_at_first_hit:
                self._save(res.checkpoint)
        return res

    # ------------------------------------------------------------------ lower tiers
    @property
    def _saves_at_landing(self) -> bool:
        """``write_through``: a boundary is copied down as soon as it lands."""
        return self.tiers is not None and self.tiers.write_policy == "write_through"

    @property
    def _saves_at_first_hit(self) -> bool:
        """``write_through_selective``: a boundary is copied down at its first hit."""
        return self.tiers is not None and self.tiers.write_policy == "write_through_selective"

    def _save(self, ck: Checkpoint) -> None:
        """Copy ``ck`` (landed, in the tree) and its path's KV to the lower tiers now."""
        if ck.node is None or not ck.matchable:
            return
        tokens, kv = self.tree.path_prefix(ck.node, ck.pos)
        self._tier_save(tokens, kv, ck.pos, ck.handles[0], int(ck.kind))

    def _tier_save(self, tokens, kv, pos: int, handle: int, kind: int) -> None:
        try:
            self.tiers.save(tokens, kv, pos, handle, kind)  # type: ignore[union-attr]
        except Exception:  # a tier failing must never take the device cache down with it
            self.counters.tier_errors += 1
            logger.exception("k3 tier: saving the boundary at %d failed; it is not kept below", pos)

    def prefetch(self, tokens: Sequence[int]) -> None:
        """A waiting request was looked at (sorted or refreshed): have the lower tiers start
        copying its deepest boundary up to host memory, so its admission does not wait for L3."""
        if self.tiers is None or len(tokens) < 2:
            return
        try:
            _, mla_len, restore = self.tree.peek(tokens)
            self.tiers.prefetch(tokens, floor=restore, cap=len(tokens) - 1, device_kv=mla_len)
        except Exception:
            self.counters.tier_errors += 1
            logger.exception("k3 tier: prefetch lookup failed")

    PROMOTE_ATTEMPTS = 3  # boundaries tried per admission when a deeper one fails to load

    def _promote(self, tokens: Sequence[int], room: Optional[int] = None) -> None:
        """Bring the deepest boundary the lower tiers hold past the device's own restore point
        onto the device: its missing KV into fresh KV slots, inserted into the tree, and its state
        as a ready checkpoint. A boundary with a part missing or invalid is a miss and the next
        shallower one is tried (up to :attr:`PROMOTE_ATTEMPTS`); nothing changes when none loads
        or the device has no room for it now."""
        tiers = self.tiers
        if tiers is None or len(tokens) < 2:
            return
        cap = len(tokens) - 1
        for _ in range(self.PROMOTE_ATTEMPTS):
            path, mla_len, restore = self.tree.peek(tokens)
            try:
                plan = tiers.find(tokens, floor=restore, cap=cap, device_kv=mla_len)
            except Exception:
                self.counters.tier_errors += 1
                logger.exception("k3 tier: lookup failed; serving from the device only")
                return
            if plan is None:
                return
            if room is not None and plan.pos - plan.kv_from > room:
                tiers.counters.load_no_memory += 1  # its KV would take memory promised to others
                return
            outcome = self._promote_plan(tokens, path, restore, plan)
            if outcome != "retry":
                return
            cap = plan.pos - 1

    def _promote_plan(self, tokens: Sequence[int], path: list, restore: int, plan) -> str:
        """One boundary up: ``"done"``, ``"retry"`` (a part failed to load: nothing was written)
        or ``"stop"`` (no room, or an error)."""
        tiers = self.tiers
        anchor = path[-1] if path else None
        if anchor is not None:
            self.tree.inc_lock_ref(anchor)  # the KV below the boundary stays while we allocate
        new_kv: Optional[list[int]] = None
        handle: Optional[int] = None
        try:
            n = plan.pos - plan.kv_from
            new_kv = self._alloc_kv(n) if n else []  # type: ignore[misc]
            handle = self.store.alloc() if new_kv is not None else None
            if new_kv is None or handle is None:
                tiers.counters.load_no_memory += 1
                return "stop"
            kind = tiers.load(plan, new_kv, handle)
            if kind is None:
                return "retry"
            kv = self.tree.prefix_kv(path, plan.kv_from) + list(new_kv)
            ins = self.insert(tokens[: plan.pos], kv)
            new_kv = None  # the tree's now (insert freed any it already held)
            ck = self.tree.add_checkpoint(
                ins.node,
                plan.pos,
                [handle],
                self.store.slot_bytes,
                kind=CheckpointKind(kind) or CheckpointKind.GEN_END,
                ready=True,
            )
            if ck is not None:
                handle = None
                tiers.count_gain(plan, plan.pos - restore)
            return "done"
        except Exception:
            self.counters.tier_errors += 1
            logger.exception("k3 tier: bringing the boundary at %d up failed; serving from the device only", plan.pos)
            return "stop"
        finally:
            if new_kv:
                self._free_kv(list(new_kv))
            if handle is not None:
                self.store.free([handle])
            if anchor is not None:
                self.tree.dec_lock_ref(anchor)

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
        if self.park_every:
            wanted += [p for p in grid if p % self.park_every == 0 and p not in wanted]
        return wanted

    def store_exports(self, rid: str, node: Node, end: int, source: ExportSource) -> None:
        """Keep the exported states :meth:`export_plan` wanted: the last grid point before the
        prompt end (a repeated or contained prompt still hits) and the one at or below the
        branch point (requests sharing only that prefix hit)."""
        rec = self.requests.get(rid)
        wanted = self.placement.export_candidates(
            source.grid(), end, rec.prompt_len if rec else None, rec.branch_point if rec else None
        )
        if rec is not None and not any(k & CheckpointKind.BRANCH for k in wanted.values()):
            self._restored_is_branch_state(rec)
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
        if self.park_every:
            self._park(node, source, wanted)

    def _park(self, node: Node, source: ExportSource, wanted) -> None:
        """Save the extend's exported states at multiples of ``park_every`` to the lower tiers
        only: each through a transient checkpoint slot, freed right after."""
        for pos in source.grid():
            if pos % self.park_every or pos in wanted or pos > node.end or not source.kept(pos):
                continue
            tokens, kv = self.tree.path_prefix(node, pos)
            if self.tiers.holds(tokens, pos):  # type: ignore[union-attr]
                continue
            handle = self._pinned(node, self.store.capture_export, source, pos)
            if handle is None:
                return
            try:
                self._tier_save(tokens, kv, pos, handle, int(CheckpointKind.CHUNK))
                self.counters.tier_parked += 1
            finally:
                self.store.free([handle])

    def _restored_is_branch_state(self, rec: RequestRecord) -> None:
        """The request forks off the tree at its branch point, and its extend exported no state
        between its restore point and that fork (it restored less than one grid step below it):
        the state it restored from, inside the node the fork splits, is then the deepest one
        before the fork, the one every later fork there restores from. Mark it a branch state
        (``BRANCH``), as the exported one would have been, so that the turn ends of the requests
        sharing it do not drop it as superseded (:meth:`_drop_superseded`) and the per-path cap
        does not recycle it."""
        ck = rec.restored
        if (
            not self.placement.at_branch_points
            or ck is None
            or ck.node is None
            or rec.branch_point is None
            or ck.pos >= rec.branch_point  # at the fork itself: is_branch_point judges it
        ):
            return
        ck.kind |= CheckpointKind.BRANCH
        ck.superseded = False

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

    def decode_due(self, seq_len: int) -> bool:
        return self.placement.decode_checkpoint(seq_len)

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
        """One state per turn. A request leaves states at its chunk ends, its prompt end (two: the
        exported grid point below it, so an identical prompt hits, and the prompt end itself) and
        its generation end. The next turn of a conversation extends the whole sequence and
        matches the generation end, so the earlier ones save nothing over it for that turn; they
        would serve only a request that forks between them and the generation end. So once the
        generation-end state is in the tree, the request's earlier states go, unless there is
        evidence that such forks happen there: the state was hit, it sits where live paths part
        (:meth:`K3RadixTree.is_branch_point`), it was placed at a fork (``BRANCH``), or the
        request itself repeated a fully cached prompt (then its prompt states stay, so the next
        regeneration of that prompt hits). Measured on the conversation trace in
        ``benchmarks/results/trace_replay``; the placement flag ``drop_superseded`` turns it off."""
        rec = self.requests.get(rid)
        if rec is None or not self.has_checkpoint_at(node, up_to):
            return  # no state at the generation end: nothing supersedes the earlier ones
        freed = Freed()
        own = [(ck, 0) for ck in rec.placed]
        if rec.restored is not None:
            own.append((rec.restored, 1))  # its one hit was this request, which went on past it
        for ck, own_hits in sorted(own, key=lambda c: -c[0].pos):  # deepest first: a stub it empties is no fork
            if (
                ck.node is None
                or ck.pos >= up_to
                or ck.hits > own_hits
                or ck.pins
                or not ck.ready
                or self.tree.is_branch_point(ck)
                or (rec.repeat and ck.kind & CheckpointKind.PROMPT_END)
            ):
                continue
            if ck.kind & CheckpointKind.PROMPT_END and self._repeat_state(rec, ck):
                ck.superseded = True  # kept for a repeat of this prompt, priced at 0 (recency alone)
                continue
            freed.extend(self.tree.drop_checkpoint(ck, DropReason.RECYCLED))
        rec.placed = [ck for ck in rec.placed if ck.node is not None]
        self.tree.stats.recycled_checkpoints += freed.checkpoints
        self._apply(freed)

    def _repeat_state(self, rec: RequestRecord, ck: Checkpoint) -> bool:
        """The state an identical or contained prompt restores from: the deepest one strictly
        inside the prompt (a lookup is capped one token short of the key, so the prompt-end state
        itself never serves the same prompt again)."""
        if not self.placement.keep_repeat_state or rec.prompt_len is None or ck.pos >= rec.prompt_len:
            return False
        return not any(c.node is not None and ck.pos < c.pos < rec.prompt_len for c in rec.placed)

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
        if self._saves_at_landing:
            self._save(ck)
        attached = node is self.tree.root or node.parent is not None  # not trimmed away meanwhile
        self._apply(self.tree.recycle_path(node if attached else ck.node, self.placement))

    # ------------------------------------------------------------------ eviction
    def _apply(self, freed: Freed) -> Freed:
        """Execute the tree's actions: KV indices back to the KV pool, checkpoint handles back to
        the store, each kind in one call. With lower tiers, an evicted boundary is saved there
        first, while its KV and state are still in place."""
        if self.tiers is not None:
            for a in freed.actions:
                if isinstance(a, ReleaseCheckpoint) and a.path_tokens is not None and a.handles:
                    self._tier_save(a.path_tokens, a.path_kv, a.pos, a.handles[0], a.kind)
        kv = [i for a in freed.actions if isinstance(a, FreeKV) for i in a.indices]
        handles = [h for a in freed.actions if isinstance(a, ReleaseCheckpoint) for h in a.handles]
        if handles:
            self.store.free(handles)
        if kv:
            self._free_kv(kv)
        return freed

    def evict(self, num_tokens: int = 0, num_bytes: int = 0, spare_wanted: bool = False) -> Freed:
        """Free at least ``num_bytes`` of checkpoints and ``num_tokens`` of KV where possible
        (``spare_wanted``: as in :meth:`evict_until`)."""
        if num_bytes > 0:
            self._release_done_pins()
        return self._apply(self.tree.evict(num_tokens=num_tokens, num_bytes=num_bytes, spare_wanted=spare_wanted))

    def evict_handles(self, handles: Sequence[int]) -> Freed:
        """Evict exactly the checkpoints holding ``handles`` (e.g. the ones in a block the host
        needs back), all or nothing: if any of them is pinned or its copy has not landed, none
        goes."""
        cks = self._owners(handles)
        if any(not self.tree.checkpoint_evictable(ck) for ck in cks):
            return Freed()
        self._release_done_pins()
        freed = Freed()
        for ck in cks:
            freed.extend(self.tree.evict_checkpoint(ck))
        return self._apply(freed)

    def _owners(self, handles: Sequence[int]) -> list[Checkpoint]:
        """The checkpoints holding ``handles``, each once (a checkpoint may hold several)."""
        cks = {id(ck): ck for ck in (self.tree.checkpoint_of(h) for h in handles) if ck is not None}
        return list(cks.values())

    def rank_handle_groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]:
        """Of ``groups`` of checkpoint handles (each freeing memory only as a whole, e.g. the
        handles in one state slot's blocks), those :meth:`evict_handles` can take now, least
        valuable first by the tree's price of their checkpoints."""
        owners = [self._owners(hs) for hs in groups]
        return [[h for ck in g for h in ck.held_handles()] for g in self.tree.rank_checkpoint_groups(owners)]

    def evict_until(
        self,
        done: Callable[[], bool],
        step_bytes: int,
        keep_checkpoints: int = 0,
        group: Optional[Callable[[Checkpoint], int]] = None,
        spare_wanted: bool = False,
    ) -> Freed:
        """For a budget KV and checkpoints share: evict the least valuable of both, about
        ``step_bytes`` at a time (:meth:`K3RadixTree.evict_ranked`; ``group`` makes checkpoints
        that share a block go together), executing each batch's frees, until ``done()`` says the
        memory asked for is there or nothing more can go.

        ``spare_wanted``: no checkpoint a waiting request wants goes. Room for a new checkpoint
        asks this. A queued request's want is a known next use; a new state's use is a guess
        (a prompt end is superseded a few decode steps later; a generation end serves a next
        turn not yet queued, so it comes after every queued one). Evicting the known for the
        guess is what Belady's MIN never does: it bypasses the new one instead. Seen on the live
        A/B's ``multiturn`` under ``--pressure``: the prompt-end states of the running batch
        evicted the turn-end states of the next queued turns, which then missed."""
        total = Freed()
        if done():
            return total
        self._release_done_pins()
        while not done():
            freed = self._apply(self.tree.evict_ranked(max(1, step_bytes), keep_checkpoints, group, spare_wanted))
            if not freed.actions:
                break
            total.extend(freed)
        return total

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
            tier_errors=self.counters.tier_errors,
            tier_parked=self.counters.tier_parked,
        )
        d.update(self.store.stats())
        if self.tiers is not None:
            d.update(self.tiers.stats())
        return d


# ---------------------------------------------------------------------- construction
def placement_from_config(cfg, unit: int = 1) -> PlacementPolicy:
    """The placement the server runs, in positions of ``unit`` tokens (the server: 1; the replay:
    its symbol size). ``hit_unit`` is one position: checkpoints sit exactly where the forward left
    a state (chunk, prompt and generation ends); the kernel's 64-token grid adds more, never fewer."""
    interval = cfg.decode_checkpoint_interval
    return PlacementPolicy(
        hit_unit=1,
        at_chunk_end=cfg.checkpoint_chunk_end,
        at_prompt_end=cfg.checkpoint_prompt_end,
        at_generation_end=cfg.checkpoint_generation_end,
        at_branch_points=cfg.checkpoint_branch_points,
        decode_interval=max(1, interval // unit) if interval else None,
        per_path_budget=cfg.checkpoint_budget or None,
        drop_superseded=not cfg.checkpoint_keep_superseded,
    )


def build_tree(eviction: EvictionPolicy, page_size: int = 1) -> K3RadixTree:
    """The tree the server runs: one KDA group per TP rank, SGLang's KV page size (the tree keeps
    whole pages of KV), a one-position hit unit, and checkpoints protected by pins only (a running
    request works on its own private copy, so a lock on its path need not keep the checkpoints on
    it)."""
    check_page_size(page_size)
    return K3RadixTree(
        num_groups=1, page_size=page_size, hit_unit=1, eviction=eviction, lock_protects_checkpoints=False
    )


def check_page_size(page_size: int, with_tiers: bool = False) -> None:
    """The page sizes k3 serves (and is tested at): those that divide 64. A prefill that starts on
    a page boundary then exports its 64-token grid states on page boundaries, inside the whole
    pages the tree takes from a running request; with larger pages the grid states near a prompt
    end would more often fall in the request's last, unfinished page, which the tree does not hold
    yet. Request ends inside a page are kept as ragged leaves (:meth:`K3RadixTree.insert`), and a
    restore inside a page is copied out of it (``kv_cow_tokens``). ``with_tiers``: the lower
    tiers move KV token by token and need page size 1."""
    if page_size < 1 or STATE_GRID % page_size:
        raise ValueError(
            f"the k3 cache needs a page size that divides {STATE_GRID} (1, 2, 4, 8, 16, 32 or 64), got {page_size}"
        )
    if with_tiers and page_size > 1:
        raise ValueError("the k3 lower tiers (--k3-host-tier-gib, --k3-mooncake) need page size 1")


def build_lifecycle(
    cfg,
    store: CheckpointStore,
    eviction: EvictionPolicy,
    free_kv: Callable[[list[int]], None],
    unit: int = 1,
    tiers=None,
    alloc_kv: Optional[Callable[[int], Optional[list[int]]]] = None,
    page_size: int = 1,
) -> CacheLifecycle:
    """Everything the server's cache and the replay's ``k3`` share, from one ``K3Config`` (the
    host gives the eviction policy its cost model; the config gives it its alpha)."""
    eviction = dataclasses.replace(eviction, alpha=cfg.eviction_alpha)
    park = cfg.tier_park_interval // unit if tiers is not None else 0
    return CacheLifecycle(
        build_tree(eviction, page_size),
        placement_from_config(cfg, unit),
        store,
        free_kv,
        tiers,
        alloc_kv,
        park_every=park,
    )
