"""How a shortage in the unified budget is met: one object, used alike by the server's cache
(:mod:`sglang_k3.integration.k3_cache`) and the trace replay's ``k3`` policy.

Every shortage evicts the least valuable KV and checkpoints together
(:meth:`~sglang_k3.cache.lifecycle.CacheLifecycle.evict_until`) until the
:class:`~sglang_k3.cache.block_ledger.BlockLedger` has what was asked for, and the ledger counts
what it cost (``reclaims``, ``reclaim_evicted_bytes``). When whole blocks are needed (for KV or an
active state), the checkpoints of one block compete as one candidate; a state slot is freed by
evicting the checkpoints that borrowed its blocks. Torch-free.
"""

from __future__ import annotations

from sglang_k3.cache.actions import Freed
from sglang_k3.cache.block_ledger import BlockLedger
from sglang_k3.cache.lifecycle import CacheLifecycle


class UnifiedEviction:
    def __init__(self, lifecycle: CacheLifecycle, ledger: BlockLedger, keep_checkpoints: int = 0) -> None:
        self.lifecycle, self.ledger = lifecycle, ledger
        self.keep_checkpoints = keep_checkpoints  # --k3-min-checkpoints: KV and slot pressure stop here

    def _until(self, done, step_bytes: int, group=None, spare_wanted: bool = False) -> Freed:
        """Evict by value until ``done()``. ``group``: checkpoints that only free memory together
        (a block's, or a state slot's run of blocks) go together; when whole blocks are wanted,
        the ``--k3-min-checkpoints`` floor holds too."""
        led = self.ledger
        freed = self.lifecycle.evict_until(
            done,
            step_bytes,
            keep_checkpoints=self.keep_checkpoints if group else 0,
            group=group,
            spare_wanted=spare_wanted,
        )
        led.note_reclaim(freed.checkpoint_bytes, len(freed.kv_indices))
        return freed

    def for_checkpoint(self, nbytes: int) -> Freed:
        """Room for one more checkpoint of ``nbytes``; at ``--k3-max-checkpoints``, checkpoints
        only. Evicts about ``nbytes`` at a time, not a block: one evicted checkpoint makes room,
        and asking for a block's bytes (a stride more than a checkpoint's) took a second one.
        No checkpoint a waiting request wants goes for a new one
        (:meth:`~sglang_k3.cache.lifecycle.CacheLifecycle.evict_until`): without room the new
        one is not placed."""
        led = self.ledger
        if led.ckpt_at_cap():
            return self.lifecycle.evict(num_bytes=nbytes, spare_wanted=True)
        return self._until(led.ckpt_has_room, nbytes, spare_wanted=True)

    def for_kv(self, target: int, step_tokens: int) -> Freed:
        """Until ``target`` KV entries are allocatable, about ``step_tokens`` at a time."""
        led = self.ledger
        return self._until(
            lambda: led.kv_available() >= target, step_tokens * led.geom.kv_token_bytes, led.block_of_checkpoint
        )

    def for_active(self, want: int) -> Freed:
        """Until ``want`` state slots are whole and free, or no more can be: KV never enters the
        active region, so a slot is held only by checkpoints that borrowed its blocks; those of
        the slot they are worth least in go (the tree's price: FLOPs saved per byte, with
        recency), so a hot state, e.g. a shared system prompt's, does not go for a cold one's
        slot. A pinned or unlanded checkpoint keeps its slot (the hit being restored may sit in
        the last one): then KV and checkpoints elsewhere go by value, one candidate (a leaf's KV,
        or a slot's checkpoints) at a time, until a run of ``span`` blocks is free there."""
        led, total = self.ledger, Freed()

        def enough() -> bool:
            return led.free_slots(limit=want) >= want

        for handles in self.lifecycle.rank_handle_groups(led.active_victims()):
            if enough():
                break
            freed = self.lifecycle.evict_handles(handles)  # ranked groups are never empty
            led.note_reclaim(freed.checkpoint_bytes, 0)
            total.extend(freed)
        if not enough():  # the region's borrowers cannot go now: free a run elsewhere, by value
            total.extend(self._until(enough, 1, lambda ck: led.block_of_checkpoint(ck) // led.span))
        return total
