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

from sglang_k3.cache.block_ledger import BlockLedger
from sglang_k3.cache.lifecycle import CacheLifecycle
from sglang_k3.cache.results import Freed


class UnifiedEviction:
    def __init__(self, lifecycle: CacheLifecycle, ledger: BlockLedger, keep_checkpoints: int = 0) -> None:
        self.lifecycle, self.ledger = lifecycle, ledger
        self.keep_checkpoints = keep_checkpoints  # --k3-min-checkpoints: KV and slot pressure stop here

    def _until(self, done, step_bytes: int, whole_blocks: bool) -> Freed:
        led = self.ledger
        freed = self.lifecycle.evict_until(
            done,
            step_bytes,
            keep_checkpoints=self.keep_checkpoints if whole_blocks else 0,
            group=led.block_of_checkpoint if whole_blocks else None,
        )
        led.note_reclaim(freed.checkpoint_bytes, len(freed.kv_indices))
        return freed

    def for_checkpoint(self, nbytes: int) -> Freed:
        """Room for one more checkpoint; at ``--k3-max-checkpoints``, checkpoints only."""
        led = self.ledger
        if led.ckpt_at_cap():
            return self.lifecycle.evict(num_bytes=nbytes)
        return self._until(led.ckpt_has_room, led.geom.block_bytes, whole_blocks=False)

    def for_kv(self, target: int, step_tokens: int) -> Freed:
        """Until ``target`` KV entries are allocatable, about ``step_tokens`` at a time."""
        led = self.ledger
        return self._until(lambda: led.kv_available() >= target, step_tokens * led.geom.kv_token_bytes, True)

    def for_active(self, want: int) -> Freed:
        """Until ``want`` state slots are whole and free, or no more can be: KV never enters the
        active region, so a slot is held only by checkpoints that borrowed its blocks; those of
        the slot that holds the fewest go. A pinned or unlanded checkpoint keeps its slot (the
        hit being restored may sit in the last one): then KV and checkpoints elsewhere go by
        value, whole aligned runs at a time, until a run of ``span`` blocks is free there."""
        led, total = self.ledger, Freed()
        for handles in led.active_victims():
            if led.free_slots() >= want:
                break
            if handles:
                freed = self.lifecycle.evict_handles(handles)
                led.note_reclaim(freed.checkpoint_bytes, 0)
                total.extend(freed)
        if led.free_slots() < want:  # the region's borrowers cannot go now: free a run elsewhere, by value
            freed = self.lifecycle.evict_until(
                lambda: led.free_slots() >= want,
                led.span * led.geom.block_bytes,
                keep_checkpoints=self.keep_checkpoints,
                group=lambda ck: led.block_of_checkpoint(ck) // led.span,
            )
            led.note_reclaim(freed.checkpoint_bytes, len(freed.kv_indices))
            total.extend(freed)
        return total
