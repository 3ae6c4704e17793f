"""Copies of lower-tier boundaries into host memory while their requests wait (prefetch). Torch-free.

A waiting request whose deepest boundary lies only in a tier below host memory (Mooncake) has that
boundary's objects copied into the host tier by one background thread, so that its admission
loads from host memory instead of over the network. The lifecycle holds the request back while the
copy runs (:meth:`TierBridge.held <sglang_k3.cache.tier_bridge.TierBridge.held>`), and a load served
from host memory because a copy put it there is counted with its lead time (:meth:`CopyUp.landed`).

:class:`~sglang_k3.tiers.manager.TierManager` owns one :class:`CopyUp` and passes it its stores,
its counters and its lookup; the manager's ``prefetch`` / ``copying_up`` / ``copy_running`` /
``wait_copy_up`` verbs are this object's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from sglang_k3.tiers.ports import TierCounters, TierStore

logger = logging.getLogger(__name__)

# copied up but not loaded yet: the oldest are forgotten past this many (only the lead-time count
# reads them)
_REMEMBER_LANDED = 4096


class CopyUp:
    """The copies up into the host tier (``stores[0]``), one at a time on one thread.

    ``find(tokens, floor, cap, device_kv)``: the manager's lookup of the deepest restorable
    boundary (a :class:`~sglang_k3.tiers.manager.TierPlan` or None); its time is counted in
    ``counters.find_seconds`` here, as the manager counts its own lookups."""

    def __init__(self, stores: Sequence[TierStore], counters: TierCounters, find: Callable) -> None:
        self.stores = stores
        self.counters = counters
        self._find = find
        self._executor = None
        self._inflight: dict[str, float] = {}  # boundary key -> start of its copy
        self._landed = threading.Condition()  # notified each time a copy up ends (wait_one)
        self._prefetched: dict[str, float] = {}  # copied up, not loaded yet (oldest first, bounded)

    @property
    def possible(self) -> bool:
        """Whether a lower tier's objects can be copied up into host memory: a host tier sits
        above another tier."""
        return len(self.stores) >= 2 and self.stores[0].name == "host"

    def start(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> tuple[Optional[str], bool]:
        """Start copying into the host tier the parts of the deepest boundary in ``(floor, cap]``
        that only a lower tier holds. Returns the key of the boundary whose copy runs now (started
        here or earlier; None when none runs for it) and whether this call started it."""
        host = self.stores[0]
        if not self.possible or cap <= floor:
            return None, False
        t0 = time.perf_counter()
        try:
            plan = self._find(tokens, floor, cap, device_kv)
        finally:
            self.counters.find_seconds += time.perf_counter() - t0
        if plan is None:
            return None, False
        if plan.key in self._inflight:
            return plan.key, False
        parts = [(key, store) for _, key, store in plan.blocks if store is not host]
        if plan.store is not host:
            parts.append((plan.key, plan.store))  # the boundary last, as a save writes it
        if not parts:
            return None, False
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-tier-prefetch")
        self._inflight[plan.key] = time.perf_counter()
        self.counters.prefetches += 1
        self._executor.submit(self._copy, host, plan.key, parts)
        return plan.key, True

    def running(self, key: str) -> bool:
        """Whether the copy up of boundary ``key`` is still running (False once it landed or failed)."""
        return key in self._inflight

    def wait_one(self, timeout: float) -> bool:
        """Block until some copy up ends (landed or failed), at most ``timeout`` seconds, without
        holding the GIL; True when one ended or none runs. For a scheduler with nothing to run but
        held requests: it waits here instead of spinning, which would take the GIL from the very
        thread doing the copy."""
        with self._landed:
            if not self._inflight:
                return True
            return self._landed.wait(timeout)

    def wait_all(self, timeout: float = 30.0) -> bool:
        """Block until no copy runs (tests, shutdown); False on timeout. Woken by each copy's end,
        not by polling."""
        deadline = time.perf_counter() + timeout
        with self._landed:
            while self._inflight:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._landed.wait(left)
        return True

    def landed(self, key: str) -> Optional[float]:
        """A load is about to use boundary ``key``: when a copy up put it in host memory, forget
        that copy and return when it started (None otherwise)."""
        return self._prefetched.pop(key, None)

    def _copy(self, host: TierStore, bkey: str, parts: list) -> None:
        t0 = time.perf_counter()
        c = self.counters
        try:
            for key, store in parts:
                blob = store.get(key)
                if not blob or not host.put(key, blob):
                    c.prefetch_failures += 1
                    return
                c.prefetch_objects += 1
                c.prefetch_bytes += len(blob)
            self._prefetched[bkey] = self._inflight.get(bkey, t0)
            while len(self._prefetched) > _REMEMBER_LANDED:
                self._prefetched.pop(next(iter(self._prefetched)))
        except Exception:
            c.prefetch_failures += 1
            logger.exception("k3 tier: prefetch of %s failed", bkey)
        finally:
            c.prefetch_seconds += time.perf_counter() - t0
            with self._landed:
                self._inflight.pop(bkey, None)
                self._landed.notify_all()
