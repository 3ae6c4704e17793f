"""sglang-router 0.3.2's routing policies, as the fleet replay models them. Each rule is read from
the router's source (the ``sglang_router-0.3.2`` sdist, crate ``sgl-model-gateway`` 0.3.2); paths
below are relative to its ``src/``.

A policy picks an instance for request ``i`` from the router's view: the requests it has in flight
per instance (``loads``: routed and not yet answered; ``Worker::load``, counted by the HTTP router
for every request under ``cache_aware``, ``routers/http/router.rs``) and, for ``cache_aware``, its
own approximate prefix tree. Every instance is healthy in the replay.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Sequence

VIRTUAL_NODES = 150  # core/worker_registry.rs: VIRTUAL_NODES_PER_WORKER


def _h64(s: str) -> int:
    # The router hashes with blake3 (core/worker_registry.rs::HashRing::hash_position); any
    # uniform 64-bit hash gives the same distribution of keys.
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little")


class RoundRobin:
    """``policies/round_robin.rs``: a counter over the healthy workers, ``count % n``."""

    name = "round_robin"

    def __init__(self, n: int):
        self.n, self.count = n, 0

    def route(self, i: int, prompt: Sequence[int], session: int, loads: Sequence[int]) -> int:
        k = self.count % self.n
        self.count += 1
        return k


class SessionRing:
    """``policies/consistent_hashing.rs`` with ``X-SMG-Routing-Key: <session>``: the key's hash on
    a ring of 150 points per worker (``hash(url#v)``); the first worker clockwise is the primary.
    The replay's session of a request is the first turn of its conversation (``trace.parent``)."""

    name = "session"

    def __init__(self, n: int):
        pts = sorted((_h64(f"http://instance-{k}#{v}"), k) for k in range(n) for v in range(VIRTUAL_NODES))
        self.pos = [p for p, _ in pts]
        self.owner = [k for _, k in pts]

    def route(self, i: int, prompt: Sequence[int], session: int, loads: Sequence[int]) -> int:
        j = bisect.bisect_left(self.pos, _h64(f"session-{session}"))
        return self.owner[j % len(self.owner)]


class CacheAware:
    """``policies/cache_aware.rs::select_worker`` with the CLI defaults (``router_args.py``:
    ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5):

    - imbalanced (``max_load - min_load > 64`` and ``max_load > 1.5 * min_load``): the least loaded
      worker (first of equals), and the request is inserted into the tree for it;
    - else the longest prefix match of the request's text in the router's tree
      (``policies/tree.rs::prefix_match_with_counts``); if matched characters / request characters
      ``> 0.3``, the tenant that last touched the matched node; else the least loaded worker.

    The tree holds request text (for ``input_ids``, the ids joined by spaces:
    ``protocols/generate.rs``); here one symbol (64 tokens) stands for a fixed run of characters,
    so the match ratio is the same. Not modelled: the tree's periodic LRU eviction to
    ``max_tree_size`` (2^26 characters, every 60 s), which the trace's prompts do not reach in a
    few minutes of simulated time at most.
    """

    name = "cache_aware"
    cache_threshold, abs_threshold, rel_threshold = 0.3, 64, 1.5

    def __init__(self, n: int):
        self.n = n
        self.root: dict = {}  # symbol -> [children, last_tenant]

    def _insert(self, prompt: Sequence[int], k: int) -> None:
        node = self.root
        for s in prompt:
            child = node.get(s)
            if child is None:
                child = node[s] = [{}, k]
            child[1] = k
            node = child[0]

    def _match(self, prompt: Sequence[int]) -> tuple[int, int]:
        node, last, depth = self.root, -1, 0
        for s in prompt:
            child = node.get(s)
            if child is None:
                break
            depth += 1
            last = child[1]
            node = child[0]
        return depth, last

    def route(self, i: int, prompt: Sequence[int], session: int, loads: Sequence[int]) -> int:
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            k = least
        else:
            depth, tenant = self._match(prompt)
            k = tenant if prompt and depth / len(prompt) > self.cache_threshold else least
        self._insert(prompt, k)
        return k


ROUTINGS = {c.name: c for c in (RoundRobin, CacheAware, SessionRing)}
