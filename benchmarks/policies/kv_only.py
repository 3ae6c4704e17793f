"""Shared by ``oracle`` and ``fa-budget``: full-attention prefix caching (MLA KV only, no states).

The real tree with no checkpoints: a hit is the phase-1 MLA match (``MatchResult.mla_len``),
capped at ``len(prompt) - 1`` like every policy, rounded to the 64-token symbol. Eviction frees
least recently used leaves (a leaf without checkpoints is all "dead" KV to the tree, taken in LRU
order).
"""

from __future__ import annotations

from benchmarks.policies.base import TreePolicy


class KVOnlyPolicy(TreePolicy):
    def hit_of(self, m, key_len):
        return max(0, min(m.mla_len, key_len - 1))
