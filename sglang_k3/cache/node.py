"""Tree nodes and checkpoints: plain data, no behaviour beyond small derived properties.

A :class:`Node` is one radix edge: the tokens ``key`` at depths ``[start, start + len(key))`` and one
MLA KV pool index per token in ``kv``. A :class:`Checkpoint` is a KDA state snapshot *after* ``pos``
tokens, with one read-only handle per KDA layer group. It is stored on the node whose span holds its
position: ``start < pos <= end``. Checkpoints are deliberately not tied to node ends, so a
checkpoint may sit inside a node (e.g. inside a large KV page) without forcing a split there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence


class CheckpointKind(enum.IntFlag):
    """Why a checkpoint was placed. Placement uses it to decide what may be recycled."""

    CHUNK = 1  # end of a prefill chunk (intermediate; recyclable once superseded)
    PROMPT_END = 2  # end of prompt
    GEN_END = 4  # end of generation: the turn boundary the next turn matches
    DECODE = 8  # every N decode tokens (intermediate; recyclable once superseded)
    BRANCH = 16  # radix branch point (Marconi-style speculative insertion)

    @property
    def recyclable(self) -> bool:
        """Only pure intermediates may be dropped while a request runs."""
        return not (self & (CheckpointKind.PROMPT_END | CheckpointKind.GEN_END | CheckpointKind.BRANCH))


@dataclass(eq=False)
class Checkpoint:
    """KDA state after ``pos`` tokens, one handle per KDA layer group.

    ``ready`` is False until the copy/donation into the handles has landed (invariant 2):
    a not-ready checkpoint is never matched and never evicted (freeing it while a write is in
    flight would hand a slot with a pending write to the allocator).
    ``pins`` counts matches whose copy-on-write out of this checkpoint has not landed yet
    (invariant 1); a pinned checkpoint is never evicted.
    """

    id: int
    pos: int
    handles: list[Optional[int]]
    nbytes: int
    kind: CheckpointKind
    node: Optional["Node"]
    ready: bool = False
    pins: int = 0
    last_access: int = 0
    hits: int = 0  # admitted matches that restored from it (evidence it is worth keeping)
    wanted: int = 0  # clock of the last waiting-queue touch that would restore from it (tree.touch)
    superseded: bool = False  # serves only a repeat of its prompt: priced at 0, so recency alone keeps it
    watch: int = -1  # the ghosts.StateClass whose reuse its first hit counts for; -1: none
    judged: bool = False  # retention already decided to keep it past its placement rule (Retention.judge)
    # a placement rule let it go while the budget had free memory: it stays, matchable, and goes
    # first when memory is short (Retention.let_go); a hit clears it
    deferred: bool = False

    @property
    def complete(self) -> bool:
        """True when every KDA group has its handle (a partial boundary is never restorable)."""
        return all(h is not None for h in self.handles)

    @property
    def matchable(self) -> bool:
        return self.ready and self.complete

    def held_handles(self) -> list[int]:
        return [h for h in self.handles if h is not None]


@dataclass(eq=False)
class Node:
    """One radix edge. ``key``/``kv`` are parallel lists; ``children`` is keyed by the child's
    first page of tokens (a tuple of ``page_size`` ints), so at most one child can match a full
    page exactly; partial-page matches are found by scanning siblings."""

    id: int
    parent: Optional["Node"]
    start: int
    key: list[int] = field(default_factory=list)
    kv: list[int] = field(default_factory=list)
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    ragged: int = 0  # children that end inside a KV page (ragged leaves; the tree keeps the count)
    ghosts: dict = field(default_factory=dict)  # pos -> ghosts.Ghost: states let go here (start < pos <= end)
    gone: dict = field(default_factory=dict)  # first page -> ghosts.GoneSpan: KV evicted past its end

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints.values())

    def __repr__(self) -> str:  # small, for test failure messages
        return (
            f"Node(id={self.id}, span=[{self.start},{self.end}), ckpts={sorted(self.checkpoints)}, "
            f"lock={self.lock_ref})"
        )


_LCP_STRIDE = 64


def lcp(a: Sequence[int], key: Sequence[int], pos: int) -> int:
    """Length of the common prefix of ``a`` and ``key[pos:]``. Sequences of one type are compared
    a stride of 64 tokens at a time (one slice comparison in C each), then token by token inside
    the stride that differs: a cached prompt of thousands of tokens is walked at every match,
    insert and waiting-queue refresh, and the token loop alone took 0.24 ms per 4,000 tokens."""
    n = min(len(a), len(key) - pos)
    i = 0
    if type(a) is type(key):  # a list slice never equals an array's: compare like with like
        s = _LCP_STRIDE
        while i + s <= n and a[i : i + s] == key[pos + i : pos + i + s]:
            i += s
    while i < n and a[i] == key[pos + i]:
        i += 1
    return i


def differing(new: Sequence[int], start: int, old: Sequence[int], n: int) -> list[int]:
    """``new[start + i]`` for each ``i < n`` where it differs from ``old[i]``: the KV indices a
    request holds for tokens the tree holds already (an insert hands them back as duplicates).
    Usually none, which one slice comparison finds."""
    if n <= 0:
        return []
    if type(new) is type(old) and new[start : start + n] == old[:n]:
        return []
    return [new[start + i] for i in range(n) if new[start + i] != old[i]]


def page_child(children: dict, key: Sequence[int], pos: int, page: int) -> tuple[Optional[object], int]:
    """The entry of ``children`` (keyed by its first page of tokens, each with a ``key``) that
    ``key[pos:]`` continues, and how many tokens the two share: the exact first page through the
    dict; where the key diverges or ends inside the first page, the entry sharing the most tokens
    of it (with one-token pages, a missing first token matches none). A node's children and the
    ghosts of evicted KV hung past a node (:class:`~sglang_k3.cache.ghosts.EvictedKV`) are both
    looked up so."""
    if pos + page <= len(key):
        child = children.get(tuple(key[pos : pos + page]))
        if child is not None:
            return child, lcp(child.key, key, pos)
        if page == 1:
            return None, 0
    best, best_n = None, 0
    for child in children.values():
        n = lcp(child.key[:page], key, pos)
        if n > best_n:
            best, best_n = child, n
    return best, best_n
