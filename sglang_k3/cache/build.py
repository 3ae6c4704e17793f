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
from sglang_k3.cache.ranking import EvictionPolicy
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


MAX_PAGE = 256


def check_page_size(page_size: int) -> None:
    """The page sizes k3 serves (and is tested at): powers of two up to 256, so a page and the
    KDA kernel's 64-token state grid always nest (one divides the other). Up to 64, a prefill
    that starts on a page boundary exports its grid states on page boundaries; with pages of 128
    and 256 every other (or every fourth) grid state falls inside a page, where the tree keeps it
    on the node that holds the page (a checkpoint may sit anywhere in its node's span), and a
    restore there copies the page's prefix out (``kv_cow_tokens``). Grid states in a running
    request's last, unfinished page have no key yet and are not stored; the larger the page, the
    more of a prompt's last states that is. Request ends inside a page are kept as ragged leaves
    (:meth:`K3RadixTree.insert`). The lower tiers serve every one of these sizes
    (:mod:`sglang_k3.cache.tier_bridge`, "Pages")."""
    if page_size < 1 or page_size > MAX_PAGE or page_size & (page_size - 1):
        raise ValueError(
            f"the k3 cache serves KV page sizes that are powers of two up to {MAX_PAGE} "
            f"(1, 2, 4, ..., 64, 128, 256), got {page_size}"
        )


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
