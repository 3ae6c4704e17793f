"""The lifecycle's bridge to the lower tiers (host memory, Mooncake): every move of a boundary
between the device tree and a :class:`~sglang_k3.cache.ports.TierPort`, in one place.

* **Up (promotion)**, a step of admission: before a request is matched, the deepest boundary the
  tiers hold past the device's own restore point is brought onto the device (:meth:`promote`):
  its missing KV into fresh KV slots, inserted into the tree, and its state as a ready checkpoint.
  A waiting request that is only looked at starts a copy up to host memory (:meth:`prefetch`).
  A waiting request whose boundary only a tier below host memory holds (Mooncake) is held back
  while that copy runs (:meth:`held`): the scheduler admits the others meanwhile, and the held
  one's promotion then reads host memory, not the network, on the scheduler's thread.
* **Down (demotion)**: an eviction's boundaries arrive as
  :class:`~sglang_k3.cache.actions.SaveBoundary` actions, one batch (:meth:`save_boundaries`); the write
  policies copy a boundary down when it lands (``write_through``) or at its first hit
  (``write_through_selective``) (:meth:`save`); dense parking saves a prefill's exported states
  every ``park_every`` positions straight below (:meth:`park`).

A tier that fails never takes the device cache down: its error is logged and counted
(``tier_errors``), and the request is served from the device. Torch-free.

**Pages.** Tier objects hold KV token-major, cut at any token, and say nothing of the device's page
size: what a server at page 1 saved, one at page 64 restores, and the reverse. With pages of ``p``
tokens a promotion counts the device's KV only to the last whole page it matched (the tree's pages
are shared whole, never written into), loads the rest into fresh pages, and inserts a boundary
that ends inside a page as a finished request's end is inserted (ragged: the tree keeps its last,
partial page); a request that restores there copies that page's prefix out, as on the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from sglang_k3.cache.actions import SaveBoundary
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.ports import CheckpointStore, ExportSource, TierPort
from sglang_k3.cache.results import InsertResult
from sglang_k3.cache.tree import K3RadixTree

logger = logging.getLogger(__name__)


@dataclass
class BridgeCounters:
    tier_errors: int = 0  # a lower tier raised (logged; the device cache carried on)
    tier_parked: int = 0  # exported states saved straight to the lower tiers (dense states)
    tier_held: int = 0  # waiting requests held back while their boundary was copied up to host memory
    tier_held_seconds: float = 0.0  # how long, summed over them (until the copy landed or failed)
    tier_held_expired: int = 0  # of them, let go after HOLD_LIMIT_S with the copy still running
    tier_hold_lookups: int = 0  # lower-tier lookups made to decide whether to hold a waiting request
    tier_hold_waits: int = 0  # scheduler calls that had only held requests and waited for a copy (wait_held)


class TierBridge:
    PROMOTE_ATTEMPTS = 3  # boundaries tried per admission when a deeper one fails to load
    # A request is held back while its boundary is copied up at most this long: a copy that
    # hangs (a lower tier that stopped answering) must not keep a request waiting for ever.
    HOLD_LIMIT_S = 10.0
    _HOLDS_KEPT = 4096  # hold records kept for requests that left without being admitted
    # At most this many waiting requests are looked at per scheduling call, from the queue's head
    # (fewer when the call can admit fewer): each lookup past the device asks Mooncake which
    # objects it has.
    HOLD_LOOKAHEAD = 16
    # When held requests are all a scheduling call has (nothing admitted, nothing running), the
    # scheduler waits this long at most for a copy up to land before its next iteration.
    HOLD_IDLE_WAIT_S = 0.005

    def __init__(
        self,
        tree: K3RadixTree,
        store: CheckpointStore,
        tiers: TierPort,
        alloc_kv: Callable[[int], Optional[list[int]]],
        free_kv: Callable[[list[int]], None],
        insert: Callable[..., InsertResult],  # (tokens, kv, ragged=False)
        park_every: int = 0,
    ) -> None:
        self.tree, self.store, self.tiers = tree, store, tiers
        self._alloc_kv, self._free_kv, self._insert = alloc_kv, free_kv, insert
        # Dense states below the device: every ``park_every`` positions of a prefill, the exported
        # state goes straight to the lower tiers (not into the tree), so a later first-time fork
        # inside this prompt restores close to where it forks. 0: off.
        self.park_every = park_every
        self.counters = BridgeCounters()
        # rid -> (key of the boundary being copied up or None, its start, the eviction count
        # when the request was last looked up) (:meth:`held`); dropped at admission (:meth:`forget`)
        self._holds: dict[str, tuple[Optional[str], float, int]] = {}

    # ------------------------------------------------------------------ down
    @property
    def saves_at_landing(self) -> bool:
        """``write_through``: a boundary is copied down as soon as it lands."""
        return self.tiers.write_policy == "write_through"

    @property
    def saves_at_first_hit(self) -> bool:
        """``write_through_selective``: a boundary is copied down at its first hit."""
        return self.tiers.write_policy == "write_through_selective"

    def save(self, ck: Checkpoint) -> None:
        """Copy ``ck`` (landed, in the tree) and its path's KV to the lower tiers now."""
        if ck.node is None or not ck.matchable:
            return
        tokens, kv = self.tree.path_prefix(ck.node, ck.pos)
        self._save([(tokens, kv, ck.pos, ck.handles[0], int(ck.kind))])

    def save_boundaries(self, actions: Sequence[SaveBoundary]) -> None:
        """Run an eviction's demotions, as one batch (the executor calls it before the frees)."""
        self._save([(a.tokens, a.kv, a.pos, a.handle, a.kind) for a in actions])

    def _save(self, boundaries: list) -> None:
        try:
            self.tiers.save_many(boundaries)
        except Exception:  # a tier failing must never take the device cache down with it
            self.counters.tier_errors += 1
            logger.exception("k3 tier: saving %d boundaries failed; they are not kept below", len(boundaries))

    def park_positions(self, grid: Sequence[int], planned: Sequence[int]) -> list[int]:
        """Of an extend's exported ``grid``, the positions to keep for parking beyond ``planned``."""
        if not self.park_every:
            return []
        return [p for p in grid if p % self.park_every == 0 and p not in planned]

    def park(self, node: Node, source: ExportSource, wanted, capture: Callable[..., Optional[int]]) -> None:
        """Save the extend's exported states at multiples of ``park_every`` to the lower tiers
        only: each through a transient checkpoint slot (``capture(source, pos)``, run with the
        path locked), freed right after."""
        for pos in source.grid():
            if pos % self.park_every or pos in wanted or pos > node.end or not source.kept(pos):
                continue
            tokens, kv = self.tree.path_prefix(node, pos)
            if self.tiers.holds(tokens, pos):
                continue
            handle = capture(source, pos)
            if handle is None:
                return
            try:
                self._save([(tokens, kv, pos, handle, int(CheckpointKind.CHUNK))])
                self.counters.tier_parked += 1
            finally:
                self.store.free([handle])

    # ------------------------------------------------------------------ up
    def prefetch(self, tokens: Sequence[int]) -> None:
        """A waiting request was looked at (sorted or refreshed): have the lower tiers start
        copying its deepest boundary up to host memory, so its admission does not wait for L3."""
        if len(tokens) < 2:
            return
        try:
            _, mla_len, restore = self.tree.peek(tokens)
            self.tiers.prefetch(tokens, floor=restore, cap=len(tokens) - 1, device_kv=self._whole_pages(mla_len))
        except Exception:
            self.counters.tier_errors += 1
            logger.exception("k3 tier: prefetch lookup failed")

    @property
    def may_hold(self) -> bool:
        """Whether :meth:`held` can ever hold a request: a host tier sits above another tier."""
        return self.tiers.copies_up

    def held(self, rid: str, tokens: Union[Sequence[int], Callable[[], Sequence[int]]]) -> bool:
        """Whether the waiting request ``rid`` should stay in the queue for now. When it is first
        asked, and again whenever the device tree has evicted since (what it lost, or what the
        writer thread has landed below since, may be only in Mooncake now), the deepest boundary
        past the device's restore point that only a tier below host memory holds starts copying
        up (as :meth:`prefetch`). The request is held while that copy runs, at most
        :attr:`HOLD_LIMIT_S`; its promotion at admission then reads host memory. Between
        evictions nothing is looked up again. ``tokens``: the request's tokens, or a callable that
        gives them (the scheduler asks every iteration; a waiting request's tokens are built only
        when a lookup is due)."""
        if not self.tiers.copies_up:
            return False
        hold = self._holds.get(rid)
        epoch = self._eviction_epoch()
        if hold is not None:
            key, t0, seen = hold
            if key is not None:
                waited = time.perf_counter() - t0
                if self.tiers.copy_running(key):
                    if waited < self.HOLD_LIMIT_S:
                        return True
                    self.counters.tier_held_expired += 1
                self.counters.tier_held_seconds += waited
                self._holds[rid] = (None, 0.0, seen)
                return False
            if seen == epoch:
                return False
        key = None
        if callable(tokens):
            tokens = tokens()
        if len(tokens) >= 2:
            self.counters.tier_hold_lookups += 1
            try:
                _, mla_len, restore = self.tree.peek(tokens)
                key = self.tiers.copying_up(tokens, restore, len(tokens) - 1, self._whole_pages(mla_len))
            except Exception:
                self.counters.tier_errors += 1
                logger.exception("k3 tier: lookup for a waiting request failed; it is not held")
        if hold is None and len(self._holds) >= self._HOLDS_KEPT:  # requests aborted while waiting
            self._holds.pop(next(iter(self._holds)))
        self._holds[rid] = (key, time.perf_counter(), epoch)
        if key is not None:
            self.counters.tier_held += 1
        return key is not None

    def wait_held(self) -> None:
        """The scheduler has nothing to run but requests :meth:`held` keeps back: wait until a copy
        up lands, at most :attr:`HOLD_IDLE_WAIT_S`, without the GIL. Its loop would otherwise
        spin, and a spinning thread takes the GIL from the prefetch thread doing the copy every
        switch interval (SGLang yields the GIL in that loop only for its own storage tiers:
        ``Scheduler.on_idle``'s ``time.sleep(0)`` under ``enable_hicache_storage``)."""
        self.counters.tier_hold_waits += 1
        self.tiers.wait_copy_up(self.HOLD_IDLE_WAIT_S)

    def _eviction_epoch(self) -> int:
        st = self.tree.stats
        return st.evicted_kv_tokens + st.evicted_checkpoints

    def forget(self, rid: str) -> None:
        """``rid`` was admitted or left: its hold record goes (a retracted request is looked at again)."""
        self._holds.pop(rid, None)

    def promote(self, tokens: Sequence[int], room: Optional[int] = None) -> None:
        """Bring the deepest boundary the lower tiers hold past the device's own restore point
        onto the device. A boundary with a part missing or invalid is a miss and the next
        shallower one is tried (up to :attr:`PROMOTE_ATTEMPTS`); nothing changes when none loads
        or the device has no room for it now (``room``: at most this many KV tokens may come up,
        the caller's free memory not yet promised to other requests; None: no limit)."""
        if len(tokens) < 2:
            return
        tiers = self.tiers
        cap = len(tokens) - 1
        for _ in range(self.PROMOTE_ATTEMPTS):
            path, mla_len, restore = self.tree.peek(tokens)
            try:
                plan = tiers.find(tokens, floor=restore, cap=cap, device_kv=self._whole_pages(mla_len))
            except Exception:
                self.counters.tier_errors += 1
                logger.exception("k3 tier: lookup failed; serving from the device only")
                return
            if plan is None:
                return
            if room is not None and plan.pos - plan.kv_from > room:
                tiers.note_no_memory()  # its KV would take memory promised to others
                return
            outcome = self._promote_plan(tokens, path, restore, plan)
            if outcome != "retry":
                return
            cap = plan.pos - 1

    def _whole_pages(self, n: int) -> int:
        """The device's KV that a promotion keeps: ``n`` tokens down to a page boundary."""
        p = self.tree.page_size
        return n // p * p

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
            p = self.tree.page_size
            # whole pages (kv_from is on a page boundary); a boundary inside a page leaves the
            # rest of its last page unused, held with the page
            new_kv = self._alloc_kv(-(-n // p) * p) if n else []
            handle = self.store.alloc() if new_kv is not None else None
            if new_kv is None or handle is None:
                tiers.note_no_memory()
                return "stop"
            kind = tiers.load(plan, new_kv[:n], handle)
            if kind is None:
                return "retry"
            kv = self.tree.prefix_kv(path, plan.kv_from) + list(new_kv[:n])
            ins = self._insert(tokens[: plan.pos], kv, ragged=plan.pos % p != 0)
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
