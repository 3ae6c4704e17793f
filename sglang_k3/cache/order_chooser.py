"""Choosing eviction's order by miniature simulation (``--k3-eviction-ranking adaptive``).

Two orders rank checkpoints for eviction (:mod:`sglang_k3.cache.retention`): the blend of recency
and prefill saved per byte, and learned hit density (:mod:`sglang_k3.cache.hit_density`). Neither
wins everywhere: in the trace replay density wins a small cache under the conversation trace and
loses at larger budgets and on other shapes (``benchmarks/RESULTS_NOTES.md``). Which one a
deployment needs is a property of its traffic and its budget, so the cache measures it.

How (miniature simulations: Waldspurger, Saemundsson, Ahmad and Park, "Cache Modeling and
Optimization using Miniature Simulations", USENIX ATC 2017): one request in ``SAMPLE`` is chosen by
a hash of its first ``KEY_SYMBOLS`` symbols, so the turns of one conversation and the questions on
one document are sampled together, as their reuse needs (a hash of the first block alone fails
where every conversation shares a system prompt). Each sampled request, when it finishes, is
replayed through two :class:`~sglang_k3.cache.simulated.SimulatedCache` of ``1 / SAMPLE`` of the
budget, one per order: the same lifecycle, placement and eviction as the cache itself, in
simulated memory (ints, no tensors). Each miniature counts the prefill tokens it restored. When the
order not in use has restored more than ``1 + MARGIN`` times what the one in use restored, over
requests since the start with older ones fading (half-life ``HALF_LIFE`` sampled requests), the
cache switches to it. The main tree's hit-density learner runs from the start whatever the order,
so a switch finds it warm.

Why these numbers: an eighth of the requests at an eighth of the budget picked the full replay's
winner at 7 of 8 budgets on the two members where the orders differ most, and the eighth was a tie
within 0.2% (``benchmarks/RESULTS_NOTES.md``, "Would miniature simulations choose right?"); the
margin keeps such ties on the blend. The cost is two small caches' work per sampled request:
about a quarter of the cache's own work. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

ORDERS = ("blend", "density")


class OrderChooser:
    SAMPLE = 4  # one request in SAMPLE is replayed, at 1 / SAMPLE of the budget
    KEY_SYMBOLS = 16  # the sample hash covers the first 16 symbols (two 512-token blocks at 64)
    Z = 2.0  # switch when one order leads by Z standard deviations
    HALF_LIFE = 256  # sampled requests: older ones count half as much after this many

    def __init__(self, tree, make_miniature: Callable[[str], object]):
        """``tree``: the cache whose ``order`` this sets. ``make_miniature(order)``: a
        :class:`~sglang_k3.cache.simulated.SimulatedCache` of ``1 / SAMPLE`` of the budget that
        evicts by ``order``."""
        self.tree = tree
        self.minis = {o: make_miniature(o) for o in ORDERS}
        self.lead = 0.0  # restored by density less restored by the blend, per request, faded
        self.var = 0.0  # the same differences squared, faded
        self.restored = dict.fromkeys(ORDERS, 0)  # restored symbols, all of them
        self._fade = 0.5 ** (1.0 / self.HALF_LIFE)
        self.sampled = 0
        self.switches = 0
        self._running: dict[str, dict] = {}  # sampled requests between admit and finish

    def sample(self, key: Sequence) -> bool:
        """Whether a request whose sequence starts with ``key`` is replayed. ``hash`` of a tuple of
        ints is the same in every process (PYTHONHASHSEED salts only str and bytes)."""
        return hash(tuple(key[: self.KEY_SYMBOLS])) % self.SAMPLE == 0

    def admit(self, rid: str, prompt: Sequence) -> None:
        """A request's prefill starts (``prompt``: its symbols): when sampled, both miniatures
        admit it and run its prefill."""
        if not self.sample(prompt):
            return
        self.sampled += 1
        runs, restored = {}, {}
        for order, mini in self.minis.items():
            m, run = mini.start(rid, prompt)
            mini.prefill(run, prompt, m)
            runs[order] = run
            restored[order] = m.restore_len
            self.restored[order] += m.restore_len
        self._running[rid] = runs
        d = restored["density"] - restored["blend"]
        self.lead = self.lead * self._fade + d
        self.var = self.var * self._fade + d * d
        # a sequential test of which order restores more: switch when the faded sum of the
        # per-request differences is Z standard deviations of itself away from 0, towards the
        # other order (ties and noise never pass it; nor does the order in use, so no flapping)
        bar = self.Z * math.sqrt(self.var)
        want = "density" if self.lead > bar else "blend" if self.lead < -bar else self.tree.order
        if want != self.tree.order:
            self.tree.order = want
            self.switches += 1

    def finish(self, rid: str, seq: Sequence, prompt_syms: int, processed: int) -> None:
        """The request ``rid`` finished: ``seq`` is prompt + output in whole symbols,
        ``prompt_syms`` the prompt's whole symbols, ``processed`` those that went through the
        model."""
        runs = self._running.pop(rid, None)
        if runs is None:
            return
        for order, mini in self.minis.items():
            mini.finish_seq(runs[order], seq, prompt_syms, processed)

    def stats(self) -> dict:
        return {
            "order": self.tree.order,
            "sampled": self.sampled,
            "switches": self.switches,
            **{f"restored_{o}": self.restored[o] for o in ORDERS},
        }


def miniature_factory(geom, budget_bytes: Optional[float], k3) -> Optional[Callable[[str], object]]:
    """``make_miniature`` for a cache of ``budget_bytes`` under ``k3`` (``geom``: its
    :class:`~sglang_k3.cache.simulated.SimGeometry`), or None where nothing is to choose: no
    budget (nothing is evicted) or an order fixed by the config."""
    if budget_bytes is None or k3.eviction_ranking != "adaptive":
        return None
    from sglang_k3.cache.simulated import SimulatedCache  # imports build, which imports nothing of this module

    def make(order: str):
        cfg = dataclasses.replace(k3, eviction_ranking=order)
        return SimulatedCache(geom, budget_bytes / OrderChooser.SAMPLE, cfg)

    return make


def to_symbols(tokens: Sequence[int], unit: int) -> list:
    """Token ids as the miniatures' symbols: one per ``unit`` tokens, a hash of its content (the
    tree matches prefixes, so content alone suffices); a partial last block is a symbol too."""
    return [hash(tuple(tokens[i : i + unit])) for i in range(0, len(tokens), unit)]
