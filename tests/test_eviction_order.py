"""Hit density, the order eviction can follow instead of the blend (``--k3-eviction-ranking
density``): learned from the cache's own hits and evictions by age
(``sglang_k3/cache/hit_density.py``), through the lifecycle the server and the replay share."""

from __future__ import annotations

import random

import pytest

from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.hit_density import HitDensity
from sglang_k3.config import K3Config
from tests.test_ghosts import _request
from tests.test_lifecycle import IntStore


def _lc(ranking: str):
    freed: list[int] = []
    cfg = K3Config(eviction_ranking=ranking)
    return build_lifecycle(cfg, IntStore(capacity=1000), EvictionPolicy(), freed.extend), freed


def _teach(d: HitDensity, hits: int, hit_age: int, end_age: int, n: int) -> None:
    """``n`` lifetimes of states with ``hits`` past hits: half end in a hit at ``hit_age``, half
    are evicted at ``end_age`` (enough events for the table to be recomputed)."""
    for _ in range(n):
        d.hit(hits, hit_age)
        d.evicted(hits, end_age)


def test_hit_density_rises_towards_the_age_of_reuse_and_falls_to_the_floor_past_it():
    """Half the states are hit at age 1,000, the rest evicted at 5,000. A state younger than
    1,000 will be hit with probability one half, and the nearer it is to 1,000 the less time it
    still holds its bytes for it: its density rises with age. Past 1,000 no state was ever hit:
    the floor, below every density with evidence, and the same at any older age."""
    d = HitDensity()
    _teach(d, 0, 1000, 5000, 512)
    young, older, past, far = (d.density(0, a) for a in (10, 800, 2000, 10**7))
    assert young < older
    assert past == far and past < young
    # the expected value: P(hit) = 1/2 over a mean time still held of (1000 + 5000)/2 - age
    assert young == pytest.approx(0.5 / (3000 - 10), rel=0.25)


def test_hit_density_learns_each_class_of_past_hits_apart():
    """States hit once before come back at 3,000; fresh ones are never hit past 1,000. At age
    2,000 the first still have evidence of a hit ahead, the others only the floor."""
    d = HitDensity()
    _teach(d, 0, 1000, 5000, 256)
    _teach(d, 1, 3000, 5000, 256)
    assert d.density(1, 2000) > d.density(0, 2000)
    assert d.density(5, 2000) == d.density(2, 2000)  # two hits or more: one class


def test_by_hit_density_an_older_state_about_to_be_reused_outlives_a_fresh_one():
    """Two equal turn ends (same span, same bytes), one placed about 900 lookups ago, one just
    now. The blend evicts the older (recency). When the cache has learned that states are hit at
    age 1,000 or never, the older one is nearer its reuse and worth more per unit of time than
    the fresh one: density evicts the fresh one."""
    first_out = {}
    for ranking in ("blend", "density"):
        lc, _ = _lc(ranking)
        rng = random.Random(0)
        a = [rng.randrange(1 << 30) for _ in range(256)]
        b = [rng.randrange(1 << 30) for _ in range(256)]
        _request(lc, "a", a, [1, 2], slot=1)
        for _ in range(880):  # the clock moves on: lookups of something else
            lc.tree.match_prefix([5, 6, 7], pin=False)
        _request(lc, "b", b, [1, 2], slot=2)
        if lc.tree.density is not None:
            _teach(lc.tree.density, 0, 1000, 5000, 512)
        ends = sorted((c for c in lc.tree.checkpoints() if c.pos == 258), key=lambda c: c.last_access)
        assert len(ends) == 2
        old, fresh = ends
        assert lc.tree.expected_saving(old) == lc.tree.expected_saving(fresh)
        order = lc.tree.rank_checkpoint_groups([[old], [fresh]])
        first_out[ranking] = "old" if order[0] == [old] else "fresh"
    assert first_out == {"blend": "old", "density": "fresh"}


def test_bad_eviction_ranking_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="blend, density"):
        K3Config(eviction_ranking="lru")
