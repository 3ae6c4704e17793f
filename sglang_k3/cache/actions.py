"""What the tree gives back, as typed actions, and the one place that carries them out.

The tree never frees, copies or saves anything itself: an eviction, a recycle or a reset returns a
:class:`Freed`, a list of actions in the order they happened, and the lifecycle hands it to its
:class:`ActionExecutor`:

* :class:`SaveBoundary`: a demotion. An evicted boundary (its state and the KV of its prefix,
  captured while both are still in place) is copied to the lower tiers; emitted only when the tree
  is told a lower tier exists (``K3RadixTree.capture_evicted``).
* :class:`ReleaseCheckpoint`: every KDA group's handle of one boundary goes back to the checkpoint
  store at once (invariant 3).
* :class:`FreeKV`: MLA KV pool indices go back to the KV pool.

The executor runs every demotion first, while the KV and states are still unfreed, then the
releases and the frees, each kind in one call. Demotions are steps of their own so that a later
executor can run them off the scheduler's path without changing what the tree decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union


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


@dataclass(frozen=True)
class SaveBoundary:
    """Demote an evicted boundary: the state in ``handle`` after ``pos`` tokens and the KV indices
    ``kv`` of its prefix ``tokens``, captured before the eviction's frees run."""

    tokens: list[int]
    kv: list[int]
    pos: int
    handle: int
    kind: int = 0


CacheAction = Union[FreeKV, ReleaseCheckpoint, SaveBoundary]


@dataclass
class Freed:
    """What an eviction, recycle or reset gives back, as typed actions in the order they happened,
    with the totals alongside."""

    actions: list = field(default_factory=list)  # CacheAction
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
        """Release one boundary; with ``path`` (its tokens and KV, captured for a lower tier) a
        :class:`SaveBoundary` of it comes first."""
        if path is not None and handles:
            self.actions.append(SaveBoundary(list(path[0]), list(path[1]), pos, handles[0], int(kind)))
        self.actions.append(ReleaseCheckpoint(list(handles), pos, nbytes, reason, int(kind)))
        self.handles.extend(handles)
        self.checkpoint_bytes += nbytes
        self.checkpoints += 1

    def extend(self, other: "Freed") -> None:
        self.actions.extend(other.actions)
        self.kv_indices.extend(other.kv_indices)
        self.handles.extend(other.handles)
        self.checkpoint_bytes += other.checkpoint_bytes
        self.checkpoints += other.checkpoints

    def saves(self) -> list[SaveBoundary]:
        return [a for a in self.actions if isinstance(a, SaveBoundary)]


class ActionExecutor:
    """Carries out a :class:`Freed`: its demotions through ``save`` in one call (None: no lower
    tier; one call, so the tier moves them as one batch), then the checkpoint handles back to
    ``free_handles`` and the KV back to ``free_kv``, each in one call."""

    def __init__(
        self,
        free_handles: Callable[[Sequence[int]], None],
        free_kv: Callable[[list[int]], None],
        save: Optional[Callable[[list[SaveBoundary]], None]] = None,
    ) -> None:
        self._free_handles, self._free_kv, self._save = free_handles, free_kv, save

    def run(self, freed: Freed) -> Freed:
        saves = freed.saves()
        if self._save is not None and saves:
            self._save(saves)
        handles = [h for a in freed.actions if isinstance(a, ReleaseCheckpoint) for h in a.handles]
        kv = [i for a in freed.actions if isinstance(a, FreeKV) for i in a.indices]
        if handles:
            self._free_handles(handles)
        if kv:
            self._free_kv(kv)
        return freed
