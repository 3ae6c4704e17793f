"""How a shortage in the unified budget is met: one object, used alike by the server's cache
(:mod:`sglang_k3.integration.k3_cache`) and the trace replay's ``k3`` policy.

Every shortage evicts the least valuable KV and checkpoints together
(:meth:`~sglang_k3.cache.lifecycle.CacheLifecycle.evict_until`) until the
:class:`~sglang_k3.cache.block_ledger.BlockLedger` has what was asked for, and the ledger counts
what it cost (``reclaims``, ``reclaim_evicted_bytes``). When whole blocks are needed (for KV or an
active state), the checkpoints of one block compete as one candidate. Torch-free.
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

    def for_blocks(self, want_free: int) -> Freed:
        """Until ``want_free`` blocks are free (state slots for requests about to run)."""
        led = self.ledger
        short = want_free - led.free_blocks()
        if short <= 0:
            return Freed()
        return self._until(lambda: led.free_blocks() >= want_free, short * led.geom.block_bytes, True)
