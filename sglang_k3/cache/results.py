"""Return types of the tree's public operations. Plain ints and lists, so callers (the SGLang
wrapper, the trace-replay simulator) convert them to tensors or simulated frees as they need."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

from sglang_k3.cache.node import Checkpoint, Node


@dataclass(eq=False)
class Pin:
    """Holds a matched checkpoint (all groups at once) and the KV path under it until the
    caller's copy-on-write out of the checkpoint has landed. Release with ``tree.release_pin``."""

    checkpoint: Checkpoint
    node: Node
    released: bool = False


@dataclass
class MatchResult:
    """Outcome of the two-phase lookup.

    ``mla_len``: longest token prefix whose KV is in the tree (phase 1).
    ``restore_len``: the restore boundary (phase 2): a multiple of the hit unit, ``<= mla_len`` and
    ``<= len(key) - 1``, with a ready checkpoint in every KDA group; 0 means a miss.
    ``kv_indices``: KV pool indices of tokens ``[0, restore_len)`` (exactly ``restore_len`` long).
    ``handles``: one checkpoint handle per KDA group to copy from (empty on a miss).
    ``node``: the node holding the restore boundary (``start < restore_len <= end``), root on a
    miss. Lock it (``inc_lock_ref``) for the request's lifetime.
    ``pin``: set when ``pin=True`` and there is a hit; release after the COW lands.
    ``kv_cow_tokens``: ``restore_len % page_size``: the last page is shared with the tree and only
    that many of its slots belong to the prefix; the caller must copy them to a private page
    before extending (never write into a tree page).
    ``replayed_tokens``: ``mla_len' - restore_len`` where mla_len' is mla_len capped at len-1: the
    tokens present as KV but recomputed because no checkpoint sits closer.
    """

    mla_len: int
    restore_len: int
    kv_indices: list[int]
    handles: list[int]
    node: Node
    checkpoint: Optional[Checkpoint] = None
    pin: Optional[Pin] = None
    kv_cow_tokens: int = 0
    replayed_tokens: int = 0


@dataclass
class InsertResult:
    """``prefix_len``: leading tokens already in the tree before this insert.
    ``inserted_len``: the length the tree now holds for this key: ``len(key)`` rounded down to
    ``page_size``, or all of it for a ragged insert; ``kv[inserted_len:]`` stays the caller's.
    ``duplicate_kv``: indices the caller frees: its own in ``[0, inserted_len)`` that the tree did
    not take because it already held those tokens with other indices, and those of ragged leaves
    the insert made redundant (their checkpoints moved to the node that now holds their tokens).
    ``node``: the node holding position ``inserted_len`` at its end, or (a ragged end that an
    existing node already covers) inside its span; root when 0."""

    prefix_len: int
    inserted_len: int
    duplicate_kv: list[int]
    node: Node


class DropReason(enum.Enum):
    """Why the tree let go of a checkpoint: what a caller with a lower memory tier may do with it."""

    EVICTED = "evicted"  # memory pressure: worth keeping below (a host tier demotes it instead)
    RECYCLED = "recycled"  # superseded on its path by the placement policy: not worth keeping
    DROPPED = "dropped"  # the caller asked (e.g. its store was refused)
    RESET = "reset"  # the whole tree was flushed


@dataclass(frozen=True)
class FreeKV:
    """Give these MLA KV pool indices back."""

    indices: list[int]


@dataclass(frozen=True)
class ReleaseCheckpoint:
    """The tree no longer holds this boundary (``pos``): every KDA group's handle comes back at
    once (invariant 3)."""

    handles: list[int]
    pos: int
    nbytes: int
    reason: DropReason
    kind: int = 0  # the checkpoint's CheckpointKind flags
    # An evicted boundary a lower tier may keep: the tokens and KV indices of its path up to
    # ``pos``, captured while the KV is still in the tree (only when the tree is asked to).
    path_tokens: Optional[list[int]] = None
    path_kv: Optional[list[int]] = None


CacheAction = Union[FreeKV, ReleaseCheckpoint]


@dataclass
class Freed:
    """What an eviction, recycle or reset gives back to the pools, as typed actions the caller
    executes (the tree never frees anything itself: pool accounting stays with the caller), with
    the totals alongside."""

    actions: list = field(default_factory=list)  # CacheAction, in the order they happened
    kv_indices: list[int] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    checkpoint_bytes: int = 0
    checkpoints: int = 0

    def add_kv(self, indices: list[int]) -> None:
        if indices:
            self.actions.append(FreeKV(list(indices)))
            self.kv_indices.extend(indices)

    def add_checkpoint(
        self,
        handles: list[int],
        pos: int,
        nbytes: int,
        reason: DropReason,
        kind: int = 0,
        path: Optional[tuple[list[int], list[int]]] = None,
    ) -> None:
        tokens, kv = path if path is not None else (None, None)
        self.actions.append(ReleaseCheckpoint(list(handles), pos, nbytes, reason, int(kind), tokens, kv))
        self.handles.extend(handles)
        self.checkpoint_bytes += nbytes
        self.checkpoints += 1

    def extend(self, other: "Freed") -> None:
        self.actions.extend(other.actions)
        self.kv_indices.extend(other.kv_indices)
        self.handles.extend(other.handles)
        self.checkpoint_bytes += other.checkpoint_bytes
        self.checkpoints += other.checkpoints
