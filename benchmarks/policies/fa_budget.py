"""``fa-budget``: full-attention prefix caching (MLA KV only, LRU) within the same byte budget.
A hybrid cache needs the same KV plus states to hit, so on one memory tier this is its ceiling
(up to eviction-order differences: a hybrid with a smarter order than LRU can exceed it)."""

from __future__ import annotations

import dataclasses

from benchmarks.policies.base import ScaledCost, SimConfig
from benchmarks.policies.kv_only import KVOnlyPolicy
from sglang_k3.cache import EvictionPolicy


class FaBudgetPolicy(KVOnlyPolicy):
    name = "fa-budget"

    def __init__(self, cfg: SimConfig, budget_bytes):
        ev = dataclasses.replace(
            EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), alpha=0.0, kv_dtype=cfg.kv_dtype
        )
        super().__init__(cfg=cfg, budget_bytes=budget_bytes, eviction=ev)
