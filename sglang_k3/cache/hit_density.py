"""Hit density: what a held byte is expected to earn, learned from the cache's own hits and
evictions as a function of a state's age (LHD: Beckmann, Chen and Cidon, "LHD: Improving Cache
Hit Rate by Maximizing Hit Density", NSDI 2018).

A state's *age* is the logical clock since it was placed or last restored from. Each lifetime
ends in one of two events, both recorded here by age: a hit (an admitted restore from it) or an
eviction. From the two histograms, for a state that has reached age ``a``:

* ``P(hit | a)``: the hits at ages past ``a`` over all lifetimes that reached ``a``;
* ``L(a)``: the time those lifetimes still held their bytes past ``a``;

and its hit density is ``P(hit | a) / L(a)``: hits per unit of time it will keep its bytes.
Ranking multiplies that by what one hit saves per byte held (:mod:`~sglang_k3.cache.retention`
prices a state), so a candidate's key is the prefill it is expected to save per byte per unit of
time. Nothing is set by hand but the histogram's resolution and its decay: the shape of reuse
over age (how long after a turn its next turn comes, how soon a document is asked about again)
is what the traffic shows.

Ages past every recorded event have no evidence of a hit: their density is the floor, and such a
state goes before any with evidence (LHD's rule: a state older than every observed reuse has
outlived its use). Torch-free.
"""

from __future__ import annotations

import math


class HitDensity:
    SUB = 4  # histogram buckets per doubling of age
    BUCKETS = 4 * 48  # ages up to 2**48 clock ticks
    RECOMPUTE_EVERY = 256  # events between two recomputations of the density table
    DECAY_EVERY = 1 << 14  # events between two halvings of the histograms (old traffic fades)

    CLASSES = 3  # by the hits a state had when its lifetime began: 0, 1, 2 or more

    def __init__(self) -> None:
        self.hits = [[0.0] * self.BUCKETS for _ in range(self.CLASSES)]
        self.ends = [[0.0] * self.BUCKETS for _ in range(self.CLASSES)]  # every lifetime's end, hits included
        self._events = 0
        self._table = [[1.0] * self.BUCKETS for _ in range(self.CLASSES)]  # no evidence yet: every age alike
        self._mid = [self._age_of(b) for b in range(self.BUCKETS)]

    def cls(self, hits: int) -> int:
        return min(hits, self.CLASSES - 1)

    def _bucket(self, age: int) -> int:
        return min(self.BUCKETS - 1, int(self.SUB * math.log2(1 + max(0, age))))

    def _age_of(self, b: int) -> float:
        """The age in the middle of bucket ``b`` (geometric)."""
        return 2.0 ** ((b + 0.5) / self.SUB) - 1

    def hit(self, hits: int, age: int) -> None:
        c, b = self.cls(hits), self._bucket(age)
        self.hits[c][b] += 1
        self.ends[c][b] += 1
        self._event()

    def evicted(self, hits: int, age: int) -> None:
        self.ends[self.cls(hits)][self._bucket(age)] += 1
        self._event()

    def _event(self) -> None:
        self._events += 1
        if self._events % self.DECAY_EVERY == 0:
            self.hits = [[h / 2 for h in row] for row in self.hits]
            self.ends = [[e / 2 for e in row] for row in self.ends]
        if self._events % self.RECOMPUTE_EVERY == 0:
            self._table = [self._recompute(c) for c in range(self.CLASSES)]

    def _recompute(self, c: int) -> list[float]:
        table = [0.0] * self.BUCKETS
        h_sum = n_sum = w_sum = 0.0  # past bucket b: hits, lifetimes, lifetimes x their age
        for b in range(self.BUCKETS - 1, -1, -1):
            h_sum += self.hits[c][b]
            n_sum += self.ends[c][b]
            w_sum += self.ends[c][b] * self._mid[b]
            left = w_sum - n_sum * self._age_of(b - 0.5)  # time held past the bucket's start
            table[b] = h_sum / left if h_sum > 0 and left > 0 else 0.0
        pos = [d for d in table if d > 0]
        floor = min(pos) / math.e if pos else 1.0
        return [d if d > 0 else floor for d in table]

    def density(self, hits: int, age: int) -> float:
        """Hits per clock tick that a state with ``hits`` past hits, of this age, is expected to
        earn until it goes."""
        return self._table[self.cls(hits)][self._bucket(age)]
