"""Building the k3 cache from one :class:`~sglang_k3.config.K3Config`, and checking what it serves.

The server's cache (:mod:`sglang_k3.integration.k3_cache`) and the replay's ``k3`` policy
(``benchmarks/policies/k3.py``) both call :func:`build_lifecycle`, so what the replay measures is
what the server runs (``tests/test_shipped_config.py``). :func:`check_page_size` is the one rule
for the KV page sizes k3 serves; ``launch_server``, the cache and the ``no_buffer`` patch ask it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sglang_k3.cache.ghosts import ReuseLearner
from sglang_k3.cache.lifecycle import CacheLifecycle
from sglang_k3.cache.placement import PlacementPolicy
from sglang_k3.cache.ports import CheckpointStore, TierPort
from sglang_k3.cache.retention import EvictionPolicy
from sglang_k3.cache.tree import K3RadixTree

# The KDA kernel's chunk: prefills export states at its multiples (the grid k3's restore points
# sit on, besides request ends). The export stash (sglang_k3/state/export_stash.py) reads it.
STATE_GRID = 64


def placement_from_config(cfg, unit: int = 1) -> PlacementPolicy:
    """The placement the server runs, in positions of ``unit`` tokens (the server: 1; the replay:
    its symbol size). ``hit_unit`` is one position: checkpoints sit exactly where the forward left
    a state (chunk, prompt and generation ends); the kernel's 64-token grid adds more, never fewer."""
    interval = cfg.decode_checkpoint_interval
    return PlacementPolicy(
        hit_unit=1,
        at_chunk_end=cfg.checkpoint_chunk_end,
        at_prompt_end=cfg.checkpoint_prompt_end,
        at_generation_end=cfg.checkpoint_generation_end,
        at_branch_points=cfg.checkpoint_branch_points,
        decode_interval=max(1, interval // unit) if interval else None,
        per_path_budget=cfg.checkpoint_budget or None,
        drop_superseded=not cfg.checkpoint_keep_superseded,
    )


def build_tree(
    eviction: EvictionPolicy, page_size: int = 1, has_slack: Optional[Callable[[], bool]] = None
) -> K3RadixTree:
    """The tree the server runs: one KDA group per TP rank, SGLang's KV page size (the tree keeps
    whole pages of KV), a one-position hit unit, and checkpoints protected by pins only (a running
    request works on its own private copy, so a lock on its path need not keep the checkpoints on
    it). ``has_slack``: whether the budget has free memory now (states the placement rules let go
    then stay until it is short: :meth:`~sglang_k3.cache.retention.Retention.let_go`)."""
    check_page_size(page_size)
    return K3RadixTree(
        num_groups=1,
        page_size=page_size,
        hit_unit=1,
        eviction=eviction,
        lock_protects_checkpoints=False,
        has_slack=has_slack,
    )


def check_page_size(page_size: int, with_tiers: bool = False) -> None:
    """The page sizes k3 serves (and is tested at): those that divide 64. A prefill that starts on
    a page boundary then exports its 64-token grid states on page boundaries, inside the whole
    pages the tree takes from a running request; with larger pages the grid states near a prompt
    end would more often fall in the request's last, unfinished page, which the tree does not hold
    yet. Request ends inside a page are kept as ragged leaves (:meth:`K3RadixTree.insert`), and a
    restore inside a page is copied out of it (``kv_cow_tokens``). ``with_tiers``: the lower
    tiers move KV token by token and need page size 1."""
    if page_size < 1 or STATE_GRID % page_size:
        raise ValueError(
            f"the k3 cache needs a page size that divides {STATE_GRID} (1, 2, 4, 8, 16, 32 or 64), got {page_size}"
        )
    if with_tiers and page_size > 1:
        raise ValueError("the k3 lower tiers (--k3-host-tier-gib, --k3-mooncake) need page size 1")


def build_lifecycle(
    cfg,
    store: CheckpointStore,
    eviction: EvictionPolicy,
    free_kv: Callable[[list[int]], None],
    unit: int = 1,
    tiers: Optional[TierPort] = None,
    alloc_kv: Optional[Callable[[int], Optional[list[int]]]] = None,
    page_size: int = 1,
    has_slack: Optional[Callable[[], bool]] = None,
) -> CacheLifecycle:
    """Everything the server's cache and the replay's ``k3`` share, from one ``K3Config`` (the
    host gives the eviction policy its cost model; the config gives it its alpha). ``has_slack``:
    the unified budget's probe of free memory (``BlockLedger.has_slack``), used unless the config
    turns ``lazy_drops`` off; None with fixed pools."""
    eviction = dataclasses.replace(eviction, alpha=cfg.eviction_alpha)
    park = cfg.tier_park_interval // unit if tiers is not None else 0
    tree = build_tree(eviction, page_size, has_slack if cfg.lazy_drops else None)
    if cfg.adaptive_retention:
        tree.reuse = ReuseLearner()
    return CacheLifecycle(
        tree,
        placement_from_config(cfg, unit),
        store,
        free_kv,
        tiers,
        alloc_kv,
        park_every=park,
    )
