"""The token comparisons every walk of the tree makes (``lcp``, ``differing``) against their
one-token-at-a-time definitions: mismatches at every offset around the 64-token stride, keys that
end first, and sequences of different types (a list against an array or a tuple, where a slice
comparison would always say "different")."""

from __future__ import annotations

import random
from array import array

from sglang_k3.cache.node import differing, lcp


def _lcp_ref(a, key, pos):
    n = min(len(a), len(key) - pos)
    i = 0
    while i < n and a[i] == key[pos + i]:
        i += 1
    return i


def test_lcp_and_differing_agree_with_token_by_token_comparison():
    rng = random.Random(20261206)
    for trial in range(400):
        n = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, rng.randint(0, 700)])
        a = [rng.randrange(5) for _ in range(n)]
        pos = rng.randint(0, 70)
        key = [rng.randrange(5) for _ in range(pos)] + list(a)
        if n and rng.random() < 0.7:
            i = rng.choice([0, n - 1, min(n - 1, 63), min(n - 1, 64), rng.randrange(n)])
            key[pos + i] += 7  # one mismatch
        if rng.random() < 0.3:
            key = key[: pos + rng.randint(0, n)]  # the key ends first
        kinds = [list, tuple, lambda x: array("q", x)]
        ka, kk = rng.choice(kinds), rng.choice(kinds)
        got = lcp(ka(a), kk(key), pos)
        assert got == _lcp_ref(a, key, pos), (trial, n, pos)
        m = min(len(a), len(key) - pos)
        want = [key[pos + i] for i in range(m) if key[pos + i] != a[i]]
        assert differing(kk(key), pos, ka(a), m) == want, (trial, n, pos)
