"""The k3 cache's side of SGLang's waiting queue: what it learns from the queued requests and
what it asks of the scheduler for them. SGLang refreshes the queue's prefixes (``touch_prefix``,
and at once after an eviction: ``refresh_waiting_now``), so eviction knows which checkpoints the
queue will restore from and in what order; with lower tiers a request whose boundary is still
being copied up from Mooncake stays queued (``held_back``, ``may_hold``), and a tier load at a
match leaves the batch's earlier requests their KV (``_tier_room``); a request the prefill
adder matched and then refused lets go of its hit (``match_not_admitted``). Part of
:class:`~sglang_k3.integration.k3_cache.K3RadixCache` (a mixin, as
:mod:`~sglang_k3.integration.cache_memory` is: it reads the cache's tree, lifecycle and
allocator). What eviction does with the queue's wants is decided in
:mod:`sglang_k3.cache.retention` and :mod:`sglang_k3.cache.ranking`; the scheduler's calls reach
these through :mod:`sglang_k3.integration.scheduler_verbs`."""

from __future__ import annotations

from typing import Optional, Sequence


def request_namespaced(req) -> bool:
    """Requests in a LoRA / cache-salt namespace are not shared through this tree."""
    return getattr(req, "extra_key", None) is not None or getattr(req, "cache_salt", None) is not None


class WaitingQueue:
    def _tier_room(self, rid: str) -> Optional[int]:
        """KV tokens a lower tier may bring up for ``rid`` now. SGLang matches the waiting
        requests one by one while it fills a prefill batch and allocates the batch's KV only
        after: memory a tier load takes at the match of a later request is memory the batch
        already counted on for the earlier ones (their prefill, ``_round_extend``). The free and
        evictable KV less what those earlier requests need is the room; without this guard a
        load could leave the batch's own allocation short (SGLang's "Out of memory" at
        ``alloc_for_extend``, seen in benchmarks/fleet_ab.py)."""
        if self.lifecycle.tiers is None:
            return None
        promised = sum(n for r, n in self._round_extend.items() if r != rid)
        free = self.token_to_kv_pool_allocator.available_size() + self.evictable_size()
        return max(0, free - promised)

    def touch_prefix(self, key) -> None:
        """SGLang refreshes the waiting queue's prefixes (head last) so that LRU eviction spares
        what the next requests will hit (``SchedulePolicy._touch_waiting_prefixes``, every 32
        scheduling calls, on by default): bump the path and the checkpoint a match would restore,
        and with lower tiers start copying the request's deepest boundary up to host memory. The
        extra refreshes k3 asks for while it evicts (:attr:`eviction_refresh`) only order
        eviction: they do not look the queue up in the lower tiers again (for Mooncake, a round
        trip per waiting request at every scheduling call); SGLang's own refreshes still do."""
        if key.extra_key is not None or key.cache_salt is not None or len(key) == 0:
            return
        tokens = list(key.raw_token_ids())
        self.tree.touch(tokens)
        if not self.eviction_refresh:
            self.lifecycle.prefetch(tokens)  # lower tiers: start copying its boundary up to host memory

    def refresh_waiting_now(self) -> bool:
        """Whether SGLang's waiting-queue refresh (:meth:`touch_prefix`) should run at this
        scheduling call rather than at its own interval (every 32nd call that may admit): yes
        when the tree evicted since the last such answer. The refresh tells eviction which
        checkpoints the queued requests will restore from, and in what order they will be
        admitted (:func:`~sglang_k3.cache.ranking.rank`); under pressure an order 31 calls old
        misses every request that finished since and queued its next turn. Without evictions
        the order is not read, and the refresh stays at SGLang's interval
        (``patches/schedule_policy_waiting_refresh.py``)."""
        st = self.tree.stats
        evicted = st.evicted_kv_tokens + st.evicted_checkpoints
        if evicted == self._evicted_at_refresh:
            return False
        self._evicted_at_refresh = evicted
        return True

    def held_back(self, queue: Sequence, room: int) -> list:
        """The waiting requests that should stay queued at this scheduling call, which can admit
        ``room`` more: of the first ``room`` in ``queue`` (at least one, at most
        ``TierBridge.HOLD_LOOKAHEAD``: each lookup may ask Mooncake), those whose boundary is
        being copied up from Mooncake into the host tier (:meth:`CacheLifecycle.held_for_tiers
        <sglang_k3.cache.lifecycle.CacheLifecycle.held_for_tiers>`), so that its promotion does
        not read the network on the scheduler's thread."""
        if not self.may_hold():
            return []
        return [
            req
            for req in queue[: max(1, min(room, self.lifecycle.bridge.HOLD_LOOKAHEAD))]
            if not request_namespaced(req)
            # its tokens are built only when a lookup is due (the scheduler asks every iteration)
            and self.lifecycle.held_for_tiers(req.rid, lambda r=req: [*r.origin_input_ids, *r.output_ids])
        ]

    def may_hold(self) -> bool:
        """Whether :meth:`held_back` can ever leave a request out: lower tiers with a host tier
        above another. The scheduler asks at every iteration, before it counts its free rows."""
        bridge = self.lifecycle.bridge
        return bridge is not None and bridge.may_hold

    def match_not_admitted(self, req) -> None:
        """SGLang's prefill loop matched ``req`` (its hit pinned, its restore queued) and then did
        not admit it (``PrefillAdder.add_one_req``: no room; ``patches/prefill_adder_not_admitted.py``).
        Drop what the match holds, so the batch admitted before it gets the memory it was counted
        on: a pinned hit locks its path's KV and its checkpoint, and SGLang's adder only checked
        the earlier requests against memory that was free or evictable before this match.
        Without this, the batch's KV allocation can come up short (SGLang's "Out of memory" at
        ``alloc_for_extend``). SGLang frees the request's state slot itself; its queued restore
        would write a slot that is no longer the request's, so it is cancelled too. The request
        is matched again when the loop next reaches it."""
        self.lifecycle.release_pin(req.rid)
        self._round_extend.pop(req.rid, None)
        self.matches_not_admitted += 1
