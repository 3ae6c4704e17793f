"""The KDA-aware radix tree (pure Python, no torch). See ``tree.py`` for the design."""

from sglang_k3.cache.cost_model import PRESETS, ModelCostConfig, preset
from sglang_k3.cache.eviction import EvictionPolicy
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.placement import PlacementPolicy
from sglang_k3.cache.results import (
    CacheAction,
    DropReason,
    Freed,
    FreeKV,
    InsertResult,
    MatchResult,
    Pin,
    ReleaseCheckpoint,
)
from sglang_k3.cache.stats import CacheStats, MatchRecord
from sglang_k3.cache.tree import CheckpointBusy, K3RadixTree

__all__ = [
    "PRESETS",
    "ModelCostConfig",
    "preset",
    "EvictionPolicy",
    "Checkpoint",
    "CheckpointKind",
    "Node",
    "PlacementPolicy",
    "CacheAction",
    "DropReason",
    "Freed",
    "FreeKV",
    "ReleaseCheckpoint",
    "InsertResult",
    "MatchResult",
    "Pin",
    "CacheStats",
    "MatchRecord",
    "CheckpointBusy",
    "K3RadixTree",
]
