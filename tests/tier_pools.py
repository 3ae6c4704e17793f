"""Real pools for the tier tests: MLA-like KV buffers and a checkpoint pool bound to fp32 active
states, with the server's pool IO over them."""

from __future__ import annotations

import torch

from sglang_k3.state.checkpoint_pool import CheckpointPool
from sglang_k3.tiers.torch_io import PoolTierIO


class Pools:
    """Real pools: an MLA-like KV buffer per layer and an INT8 checkpoint pool bound to fp32
    active states."""

    def __init__(self, seed: int, dtype: str = "int8", kv_slots: int = 2048, ckpt_slots: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.kv = [torch.randn(kv_slots, 1, 12, generator=g).to(torch.bfloat16) for _ in range(3)]
        L, S, H, V, K = 2, 4, 2, 4, 8
        self.temporal = torch.randn(L, S, H, V, K, generator=g)
        self.conv = torch.randn(L, S, 3, 16, generator=g)
        self.pool = CheckpointPool.from_active(self.temporal, self.conv, num_slots=ckpt_slots, dtype=dtype)
        self.io = PoolTierIO(self.kv, self.pool)
        self.next_kv = 0

    def checkpoint(self, active: int) -> int:
        (h,) = self.pool.alloc(1)
        assert self.pool.store([active], [h]).all_ok
        return h

    def fresh_kv(self, n: int) -> list[int]:
        out = list(range(self.next_kv, self.next_kv + n))
        self.next_kv += n
        return out
