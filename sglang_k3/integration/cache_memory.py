"""The k3 cache's side of SGLang's memory accounting: freeing and allocating KV for the tree, the
evictions SGLang asks for (``evict``) and the sizes it admits against (``evictable_size`` and the
rest), and the unified budget's eviction hooks (a checkpoint, an active state slot or KV short of
room). Part of :class:`~sglang_k3.integration.k3_cache.K3RadixCache` (a mixin: it reads the
cache's allocator, lifecycle, ledger and evictor). Which KV and checkpoints go is decided in
:mod:`sglang_k3.cache.retention` and :mod:`sglang_k3.cache.unified_eviction`; this only asks."""

from __future__ import annotations

from typing import Optional

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult

from sglang_k3.integration.unified_memory import index_tensor


class CacheMemory:
    def _free_kv(self, indices: list[int]) -> None:
        self.token_to_kv_pool_allocator.free(index_tensor(indices, self._kv_device))

    def _alloc_kv(self, n: int) -> Optional[list[int]]:
        """``n`` KV slots for KV brought up from a lower tier, evicting if needed; None if none."""
        alloc = self.token_to_kv_pool_allocator
        got = alloc.alloc(n)
        if got is None:
            self.evict(EvictParams(num_tokens=n))
            got = alloc.alloc(n)
        return None if got is None else got.tolist()

    def _evict_slots(self, n: int) -> int:
        """Free ``n`` mamba-pool slots held by checkpoints (only fp32 checkpoints hold any)."""
        if not self.store.shares_active_slots:
            return 0
        return len(self.lifecycle.evict(num_bytes=n * self.store.slot_bytes).handles)

    # -- unified memory: every kind's shortage is met by evicting the least valuable KV and
    # checkpoints together (sglang_k3.cache.unified_eviction, shared with the replay)
    def _evict_for_checkpoint(self, nbytes: int) -> None:
        if self.unified is None:
            self.lifecycle.evict(num_bytes=nbytes, spare_wanted=True)  # a checkpoint pool of their own
        else:
            self.evictor.for_checkpoint(nbytes)

    def _evict_for_active(self, want: int) -> None:
        self.evictor.for_active(want)

    def state_slots_ready(self, need: int) -> bool:
        """Whether ``need`` state slots can be allocated now, evicting for them if they are not
        free (what SGLang's slot allocation will ask at ``alloc_req_slots``). SGLang's prefill
        adder counts request rows, not states: under unified memory a state is ``span`` whole
        blocks of the region (or, beyond it, of free memory), and a region slot a checkpoint
        still borrows while it cannot go (pinned by a hit being restored, or its copy not landed),
        with KV fragmenting the rest, leaves fewer slots than rows. Admitting past that stops the
        server on SGLang's allocation assertion. True without unified memory (SGLang's own pool)."""
        if self.unified is None or need <= 0:
            return True
        led = self.ledger
        if led.free_slots(limit=need) >= need:
            return True
        self._evict_for_active(need)
        if led.free_slots(limit=need) >= need:
            return True
        self.state_slot_refusals += 1
        return False

    def _reclaimable_checkpoint_blocks(self) -> int:
        """Blocks outside the active region that evicting every evictable checkpoint (above the
        floor) would surely free: a block keeps out only while it holds a checkpoint that cannot
        go."""
        led = self.ledger
        held = self.tree.checkpoint_count()
        stuck = held - self.tree.evictable_checkpoint_bytes() // max(1, self.store.slot_bytes)
        stuck = max(stuck, min(held, self.cfg.min_checkpoints))
        return max(0, led.ckpt_blocks_outside_region() - stuck)

    def _evict_checkpoints_for_kv(self, n: int) -> None:
        """The KV allocator found fewer than ``n`` tokens: evict until it has them."""
        self.evictor.for_kv(n, n)

    def _evict_unified(self, params: EvictParams) -> EvictResult:
        led, result = self.ledger, EvictResult()
        if params.num_tokens > 0:
            # SGLang asks for its shortfall against the allocator's available size, which already
            # counts what evicting checkpoints would free: make all of it real in the ledger
            target = self.token_to_kv_pool_allocator.available_size() + params.num_tokens
            freed = self.evictor.for_kv(target, params.num_tokens)
            result.num_tokens_evicted = len(freed.kv_indices)
        if params.mamba_num > 0:  # short of state slots: free the region's slots checkpoints borrowed
            before = led.free_slots()
            self._evict_for_active(before + params.mamba_num)
            result.mamba_num_evicted = max(0, led.free_slots() - before)
        return result

    def evict(self, params: EvictParams) -> EvictResult:
        if self.unified is not None:
            return self._evict_unified(params)
        result = EvictResult()
        if params.num_tokens > 0:
            freed = self.lifecycle.evict(num_tokens=params.num_tokens)
            result.num_tokens_evicted = len(freed.kv_indices)
            if self.store.shares_active_slots:
                result.mamba_num_evicted += len(freed.handles)
        if params.mamba_num > 0:
            result.mamba_num_evicted += self._evict_slots(params.mamba_num)
        return result

    def evictable_size(self) -> int:
        """KV tokens eviction can free now. SGLang admits a prefill batch against available plus
        this, then evicts for it at allocation; KV held under a checkpoint whose copy has not
        landed yet (the overlap scheduler lands a finished request's at the next step) cannot be
        freed before then, so it counts as protected (:meth:`K3RadixTree.stuck_kv_tokens`)."""
        return self.tree.evictable_size() - self.tree.stuck_kv_tokens()

    def protected_size(self) -> int:
        return self.tree.protected_size() + self.tree.stuck_kv_tokens()

    full_evictable_size = evictable_size
    full_protected_size = protected_size

    def mamba_evictable_size(self) -> int:
        if not self.store.shares_active_slots:
            return 0
        return self.tree.evictable_checkpoint_bytes() // self.store.slot_bytes

    def mamba_protected_size(self) -> int:
        if not self.store.shares_active_slots:
            return 0
        return self.tree.checkpoint_count() - self.mamba_evictable_size()

    def total_size(self) -> int:
        return self.tree.total_size()
