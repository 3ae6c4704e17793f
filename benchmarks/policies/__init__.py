"""Cache policies the trace replay compares. Each drives the real ``sglang_k3.cache`` tree
(see ``base.py``); one module per policy documents the rules it models."""

from __future__ import annotations

from benchmarks.policies.base import Admission, Policy, SimConfig
from benchmarks.policies.fa_budget import FaBudgetPolicy
from benchmarks.policies.k3 import K3Alpha0Policy, K3EagerPolicy, K3FixedPolicy, K3Policy, K3RulesPolicy
from benchmarks.policies.marconi import MarconiPolicy
from benchmarks.policies.oracle import OraclePolicy
from benchmarks.policies.upstream import UpstreamInt8Policy, UpstreamPolicy
from benchmarks.policies.upstream_hicache import UpstreamHiCachePolicy
from benchmarks.policies.vllm_align import VllmAlignPolicy

POLICIES = {
    "k3": K3Policy,
    "k3-fixed": K3FixedPolicy,
    "k3-alpha0": K3Alpha0Policy,
    "k3-rules": K3RulesPolicy,
    "k3-eager": K3EagerPolicy,
    "upstream": UpstreamPolicy,
    "upstream-int8": UpstreamInt8Policy,
    "upstream-hicache": UpstreamHiCachePolicy,
    "vllm-align": VllmAlignPolicy,
    "marconi": MarconiPolicy,
    "oracle": OraclePolicy,
    "fa-budget": FaBudgetPolicy,
}

__all__ = ["POLICIES", "Admission", "Policy", "SimConfig"]
