"""Ghosts: small records of the states the tree let go, and what they teach retention.

A *ghost* is what is left of a checkpoint that was dropped at its turn's end, recycled or evicted:
its position on the node that held it, why it went, and the class of state it was. It holds no
memory beyond this record and lives exactly as long as the KV it sat on (a trim of that KV or the
node's removal takes it; a new checkpoint at its position replaces it). When a later admitted
match restores from below a ghost whose KV is still there, the ghost *would have been hit*: the
prompt tokens between the restore and the ghost were recomputed because of that decision.

Two things read ghosts:

* **Miss attribution** (:class:`MissCounts`): every prompt token a match did not restore is
  counted by its cause, from the match itself, the deepest ghost under it and the evicted KV past
  it (:class:`EvictedKV`).
* **The reuse estimate** (:class:`ReuseLearner`): per class of state (turn end, chunk end, prompt
  end, decode interval, earlier turn end), the prefill FLOPs its states saved when used again,
  counting a hit on a kept state and a ghost hit on a dropped or evicted one alike. Retention
  keeps a state that its rule would drop when its class saves at least as much per state as the
  turn-end states the cache always keeps (:meth:`~sglang_k3.cache.retention.Retention.judge`). Nothing in it is set by
  hand: on traffic whose forks fall inside earlier prompts, chunk-end states are reused and kept;
  on linear conversations they are not, and go as before.

**Evicted KV** leaves ghosts of its own (:class:`EvictedKV`): the tokens of each removed node or
trimmed tail, hung where they were cut off, so that a prompt that runs on past the cached KV is
told apart as *evicted* (the cache held those tokens) or *never seen*.

Torch-free: plain data, updated by the tree.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from sglang_k3.cache.node import CheckpointKind, page_child


class StateClass(enum.IntEnum):
    """What a state was placed as (the class its reuse is learned for)."""

    TURN = 0  # a generation end: the state the next turn restores from
    CHUNK = 1  # a prefill chunk end (or a fork's branch state)
    PROMPT = 2  # a prompt end
    DECODE = 3  # a decode-interval state
    OLD_TURN = 4  # a generation end a later turn of the same request went past

    @staticmethod
    def of(kind: CheckpointKind) -> "StateClass":
        """The class of a state a placement rule would let go (never ``TURN``: a fresh turn end is
        the reference, not judged)."""
        if kind & CheckpointKind.GEN_END:
            return StateClass.OLD_TURN
        if kind & CheckpointKind.PROMPT_END:
            return StateClass.PROMPT
        if kind & CheckpointKind.DECODE:
            return StateClass.DECODE
        return StateClass.CHUNK


class GhostReason(enum.Enum):
    DROPPED = "dropped"  # let go by a placement rule (its turn ended, or a later chunk superseded it)
    EVICTED = "evicted"  # memory pressure


@dataclass
class Ghost:
    reason: GhostReason
    watch: int = -1  # the StateClass whose reuse it still counts for; -1: none (already counted)


class ReuseLearner:
    """Per :class:`StateClass`: ``judged`` states, how many of them were ``used`` (a hit on the
    state, or on its ghost) and the prefill FLOPs those uses saved (``saved``). A class's *value*
    is the prefill it saved per state judged, with a prior of two states worth the reference
    class's value: ``(saved + 2 v_turn) / (judged + 2)``, ``v_turn`` the turn-end states' mean. So a
    class starts equal to the turn ends (kept: :meth:`keeps`), and the traffic moves it.
    Value, not the rate of use: a chunk-end state that one later fork in twenty restores from can
    save that fork 100k tokens of prefill, as much as the turn ends save on average."""

    def __init__(self) -> None:
        self.judged = [0] * len(StateClass)
        self.used = [0] * len(StateClass)
        self.saved = [0.0] * len(StateClass)

    def observe(self, cls: int) -> None:
        self.judged[cls] += 1

    def reused(self, cls: int, saved: float) -> None:
        self.used[cls] += 1
        self.saved[cls] += saved

    def value(self, cls: int) -> float:
        """Mean prefill FLOPs saved per state of ``cls`` judged."""
        ref = self.saved[StateClass.TURN] / self.judged[StateClass.TURN] if self.judged[StateClass.TURN] else 0.0
        if cls == StateClass.TURN:
            return ref
        return (self.saved[cls] + 2 * ref) / (self.judged[cls] + 2)

    def keeps(self, cls: int) -> bool:
        """Keep a state of ``cls`` that its placement rule would drop: its class saves at least as
        much prefill per state as the turn-end states do."""
        return self.value(cls) >= self.value(StateClass.TURN)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in StateClass:
            name = c.name.lower()
            out[f"reuse_{name}_judged"] = self.judged[c]
            out[f"reuse_{name}_used"] = self.used[c]
            out[f"reuse_{name}_value"] = self.value(c)
        return out


MISS_CAUSES = (
    "never_seen",  # no MLA KV for it, and the cache never held it (or forgot it: EvictedKV's horizon)
    "kv_evicted",  # no MLA KV for it: the cache held it and evicted it
    "no_state",  # KV present, but no state was ever placed between the restore point and it
    "state_dropped",  # a state there was dropped by a placement rule (turn end, recycling)
    "state_evicted",  # a state there was evicted, and no lower tier keeps evicted boundaries
    "tier_missing",  # evicted (its state, or its KV) with a lower tier on, and no tier gave it back
    "alignment",  # the last token of a fully cached prompt (a lookup never restores it)
)


@dataclass
class MissCounts:
    """Prompt tokens admitted matches did not restore, by cause (:data:`MISS_CAUSES`); they add
    up to the tokens looked up less the tokens restored."""

    never_seen: int = 0
    kv_evicted: int = 0
    no_state: int = 0
    state_dropped: int = 0
    state_evicted: int = 0
    tier_missing: int = 0
    alignment: int = 0

    def record(
        self,
        key_len: int,
        mla_len: int,
        cap: int,
        restore: int,
        ghost_pos: int,
        ghost: "Ghost | None",
        evicted_kv: int = 0,
        tiers: bool = False,
    ) -> None:
        """One match: ``mla_len`` of ``key_len`` tokens had KV, ``cap`` could be restored at most,
        ``restore`` were; ``ghost`` is the deepest state let go in ``(restore, cap]`` (at
        ``ghost_pos``), ``evicted_kv`` how many tokens past ``mla_len`` the cache held and evicted;
        ``tiers``: a lower tier keeps what the device evicts, so what it evicted and a tier did not
        give back is a tier's miss."""
        evicted = min(evicted_kv, key_len - mla_len)
        self.never_seen += key_len - mla_len - evicted
        if tiers:
            self.tier_missing += evicted
        else:
            self.kv_evicted += evicted
        self.alignment += mla_len - cap
        if ghost is not None:
            if ghost.reason is GhostReason.DROPPED:
                self.state_dropped += ghost_pos - restore
            elif tiers:
                self.tier_missing += ghost_pos - restore
            else:
                self.state_evicted += ghost_pos - restore
            self.no_state += cap - ghost_pos
        else:
            self.no_state += cap - restore

    def as_dict(self) -> dict[str, int]:
        return {f"miss_{k}_tokens": getattr(self, k) for k in MISS_CAUSES}


@dataclass(eq=False)
class GoneSpan:
    """Evicted KV: the tokens of a removed node or of a leaf's trimmed tail (``key``), and the
    spans evicted past its end before it (``after``, keyed by their first page, as a node's
    children are)."""

    key: Sequence[int]
    after: dict = field(default_factory=dict)


class EvictedKV:
    """Ghosts of evicted KV, so that a miss tells *evicted* from *never seen*. When the tree
    removes a node or trims a leaf's tail, the tokens that went hang where they were cut off, in
    the ``gone`` dict of the node they continued (its children's twin, keyed by first page), with
    what had been evicted past them before. A match that stops at a node's end follows them along
    the prompt (:meth:`run`). An insert that brings the KV back removes the ghost there.

    Bounded: the tokens recorded over the last ``cap`` go oldest first, ``cap`` being ``HORIZON``
    times the most KV the tree has held when it evicted (a cache that many times the size would
    still have held them). The removed keys are kept as packed integers (8 bytes a token), no KV:
    32 MB for a tree that holds a million tokens. Beyond the horizon, and under a span that was
    brought back, tokens count as never seen: the split is exact within the horizon and errs
    towards *never seen*."""

    MIN_CAP = 1 << 16
    HORIZON = 4

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.tokens = 0  # tokens recorded and not yet aged out
        self.cap = self.MIN_CAP
        self._order: deque = deque()  # (owner dict, page key, span), oldest first

    def add(self, owner: dict, key: Sequence[int], after: dict, held_tokens: int) -> None:
        """``key`` was evicted where ``owner`` (a node's ``gone``) hangs; ``after``: the ghosts
        that hung past its end. ``held_tokens``: the KV the tree held just before."""
        span = GoneSpan(array("q", key), after)
        page_key = tuple(key[: self.page])
        owner[page_key] = span
        self._order.append((owner, page_key, span))
        self.tokens += len(key)
        self.cap = max(self.cap, self.HORIZON * held_tokens)
        while self.tokens > self.cap and self._order:
            o, k, old = self._order.popleft()
            self.tokens -= len(old.key)
            if o.get(k) is old:
                del o[k]

    def run(self, gone: dict, key: Sequence[int], pos: int) -> int:
        """Tokens of ``key`` from ``pos`` on that the cache held and evicted, following the
        ghosts in ``gone`` (the ``gone`` of the node the match ended at, ``pos`` its end), each
        found as a node's child is (:func:`~sglang_k3.cache.node.page_child`)."""
        total = 0
        while gone and pos < len(key):
            span, n = page_child(gone, key, pos, self.page)
            if span is None:
                break
            total += n
            if n < len(span.key):
                break
            pos += n
            gone = span.after
        return total
