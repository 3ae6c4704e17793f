"""KDA state slots in SGLang's mamba pool: allocation with eviction, copy, free.

A *slot* is one index into upstream's ``MambaPool`` (every KDA layer's recurrent and conv state
for one sequence). The request's active slot is private and writable; a checkpoint slot held by
the k3 tree is read-only. Both come from the same ``mamba_allocator``, so SGLang's idle leak
check (available + evictable + protected == size) stays exact.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class SlotPool:
    def __init__(self, req_to_token_pool, evict_slots: Callable[[int], int]):
        self.rtp = req_to_token_pool
        self.allocator = req_to_token_pool.mamba_allocator
        self.pool = req_to_token_pool.mamba_pool
        self._evict_slots = evict_slots
        cache = self.pool.mamba_cache
        tensors = [cache.temporal, *cache.conv]
        # Bytes one slot holds across all KDA layers (dim 1 is the slot index).
        self.slot_bytes = sum(t[:, 0].numel() * t.element_size() for t in tensors)
        self.device = cache.temporal.device

    def alloc(self) -> Optional[int]:
        """One free slot, evicting tree checkpoints if none is free; None if impossible."""
        got = self.allocator.alloc(1)
        if got is None:
            self._evict_slots(1)
            got = self.allocator.alloc(1)
        return None if got is None else int(got[0])

    def free(self, slots: list[int]) -> None:
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64, device=self.device))

    def copy(self, src: int, dst: int) -> None:
        """Copy every layer's recurrent and conv state of ``src`` into ``dst``. Issued on the
        current stream: on a GPU any later forward that reads ``dst`` is ordered after it."""
        translate = self.rtp.translate_mamba_indices
        idx = lambda s: translate(torch.tensor([s], dtype=torch.int64, device=self.device))  # noqa: E731
        self.pool.copy_from(idx(src), idx(dst))

    def index_tensor(self, slot: int) -> torch.Tensor:
        return torch.tensor([slot], dtype=torch.int64, device=self.device)
