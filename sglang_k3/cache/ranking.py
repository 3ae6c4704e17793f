"""Ranking: the order in which eviction takes its candidates (:func:`rank`), and the policy's
knobs (:class:`EvictionPolicy`). What is a candidate and what each is worth (its recency, the
FLOPs a hit on it saves, the bytes it holds, whether a waiting request wants it) is decided in
:mod:`sglang_k3.cache.retention`; this module only orders them. Torch-free.

**Utility.** Eviction ranks candidates by recency + ``alpha`` x prefill FLOPs saved per byte held
(Marconi-style), LRU as tie-break (:func:`rank`).
Why a utility and not plain LRU: checkpoints differ by 1000x in value. A checkpoint at 100k
tokens whose nearest earlier checkpoint is at 0 saves the whole 100k-token prefill; one 64 tokens
after another checkpoint saves almost nothing, yet both hold the same 40 MiB. Scores are
normalised over the candidate set (min-max) so ``alpha`` weighs the two terms independent of
units; ``alpha = 0`` is pure LRU.

Efficiency is compared on a log scale. FLOPs saved per byte span orders of magnitude (attention's
cost grows with the square of the depth; a candidate's bytes run from one state to a long leaf's
KV), so on a linear scale the one or two largest set the range and every other candidate scores
about 0: the efficiency term then only protected outliers, and recency alone ranked the rest. On
a log scale each candidate is placed by its ratio to the others. Measured with the trace replay
(conversation trace, Kimi-Linear-48B, int8, token hit rate at 10/20/40/80 GiB): linear
0.051/0.084/0.164/0.256, log 0.050/0.085/0.178/0.258; fork-heavy trace at 10/40 GiB: linear
0.872/0.897, log 0.875/0.897. A candidate that saves nothing scores one e-fold below the least
positive one, so it still goes first.

What the waiting queue wants goes last. When SGLang refreshes the waiting requests' prefixes
(:meth:`~sglang_k3.cache.tree.K3RadixTree.touch`), the tree learns which checkpoints they will
restore from and in what order they will be admitted: a candidate such a request wants is a
*known* future use, the others are guesses. So every unwanted candidate goes before any wanted
one, and wanted ones go from the queue's tail to its head: the one needed last goes first
(Belady's MIN, with the queue as the lookahead). Under plain LRU a turn that just finished is
the most recent and outlives the turns queued before it, so when many conversations share a
budget too small for all of them, each is evicted just before its next turn comes (the live
A/B's ``multiturn`` under ``--pressure``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from sglang_k3.cache.cost_model import ModelCostConfig


@dataclass
class EvictionPolicy:
    cost: Optional[ModelCostConfig] = None  # None: FLOPs ~ tokens (span length)
    alpha: float = 1.0  # weight of FLOP efficiency vs recency
    kv_dtype: str = "bf16"

    def flops(self, a: int, b: int) -> float:
        if self.cost is None:
            return float(max(0, b - a))
        return self.cost.prefill_flops(a, b)

    def kv_bytes(self, tokens: int) -> int:
        per = self.cost.kv_bytes_per_token(self.kv_dtype) if self.cost is not None else 1
        return tokens * per


@dataclass(frozen=True)
class Candidate:
    """Something evictable: ``last_access`` (logical clock), ``saved_flops`` and ``nbytes``;
    ``wanted``: when a waiting request last asked for it (the clock of that refresh's touch, the
    queue's head touched last), 0 when none does."""

    obj: object
    last_access: int
    saved_flops: float
    nbytes: int
    wanted: int = 0
    deferred: bool = False  # only states a placement rule let go while memory was free (Retention.let_go)


def _norm(values: Sequence[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [0.0 for _ in values]
    return [(v - lo) / (hi - lo) for v in values]


def _log_scale(values: Sequence[float]) -> list[float]:
    """``log(v)``; a value <= 0 (saves nothing) one e-fold below the least positive one."""
    pos = [math.log(v) for v in values if v > 0]
    floor = min(pos) - 1.0 if pos else 0.0
    return [math.log(v) if v > 0 else floor for v in values]


def rank(cands: Sequence[Candidate], alpha: float) -> list[Candidate]:
    """Candidates no waiting request wants first: the deferred ones (what a placement rule let go
    while memory was free; oldest first), then the rest, lowest utility first, ties broken by
    older access first (LRU), then by insertion order; then the wanted ones, the queue's tail
    first. The deferred ones take no part in the others' normalisation, so the rest rank exactly
    as they would had the rule dropped them at once.

    Min-max normalisation ties often: of two candidates, one newer and one more efficient, both
    score exactly 1 at ``alpha = 1``. Breaking that tie by efficiency instead was measured and
    rejected: it kept a finished prompt group's hot state over the next group's fresh one on the
    live A/B's ``gsp`` under pressure (hit rate 0.109 -> 0.071)."""
    first = sorted((c for c in cands if c.deferred and not c.wanted), key=lambda c: c.last_access)
    free = [c for c in cands if not c.wanted and not c.deferred]
    wanted = sorted((c for c in cands if c.wanted), key=lambda c: c.wanted)
    if not free:
        return first + wanted
    rec = _norm([float(c.last_access) for c in free])
    eff = _norm(_log_scale([c.saved_flops / max(1, c.nbytes) for c in free]))
    scored = sorted((rec[i] + alpha * eff[i], c.last_access, i) for i, c in enumerate(free))
    return first + [free[i] for *_, i in scored] + wanted
