"""``oracle``: full-attention prefix caching with unlimited memory, the upper bound of any prefix
cache on this trace: every token ever computed (prompt and output) stays cached, a hit is the
longest cached prefix. Budget-independent (its record repeats for each budget)."""

from __future__ import annotations

from benchmarks.policies.base import SimConfig
from benchmarks.policies.kv_only import KVOnlyPolicy


class OraclePolicy(KVOnlyPolicy):
    name = "oracle"
    budget_independent = True

    def __init__(self, cfg: SimConfig, budget_bytes=None):
        super().__init__(cfg=cfg, budget_bytes=None)
