"""The KDA-aware radix tree (pure Python, no torch). See ``tree.py`` for the design."""

from sglang_k3.cache.actions import CacheAction, DropReason, Freed, FreeKV, ReleaseCheckpoint, SaveBoundary
from sglang_k3.cache.cost_model import PRESETS, ModelCostConfig, preset
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.placement import PlacementPolicy
from sglang_k3.cache.ranking import EvictionPolicy
from sglang_k3.cache.registry import CheckpointBusy
from sglang_k3.cache.results import InsertResult, MatchResult, Pin
from sglang_k3.cache.stats import CacheStats, MatchRecord
from sglang_k3.cache.tree import K3RadixTree

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
    "SaveBoundary",
    "InsertResult",
    "MatchResult",
    "Pin",
    "CacheStats",
    "MatchRecord",
    "CheckpointBusy",
    "K3RadixTree",
]
