"""Where to checkpoint, and which intermediate checkpoints to recycle. Each position is a flag.

Why sparse and typed: a Kimi-Linear checkpoint is ~40 MiB, so the positions must be the ones
likely to be matched again: prefill chunk ends cost nothing extra (the kernel exports them in the
same forward) but are mostly superseded by the next one; the prompt end and the generation end are
what a next turn matches; radix branch points have already proven that two requests share a
prefix (Marconi). A per-path budget stops one long path from taking all state memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sglang_k3.cache.node import Checkpoint, CheckpointKind


@dataclass
class PlacementPolicy:
    hit_unit: int = 64
    at_chunk_end: bool = True
    at_prompt_end: bool = True
    at_generation_end: bool = True
    decode_interval: Optional[int] = None  # e.g. 4096; None: off
    at_branch_points: bool = True
    per_path_budget: Optional[int] = 8  # checkpoints kept on one root-to-leaf path; None: no cap
    recycle_superseded: bool = True
    drop_superseded: bool = True  # one state per turn: see CacheLifecycle._drop_superseded
    keep_repeat_state: bool = True  # ... but keep the state a repeat of the same prompt restores from

    def _align(self, pos: int) -> int:
        return pos // self.hit_unit * self.hit_unit

    def plan_prefill(
        self,
        prompt_len: int,
        chunk_ends: Sequence[int],
        restore_len: int = 0,
        branch_point: Optional[int] = None,
    ) -> dict[int, CheckpointKind]:
        """Positions (hit-unit multiples in ``(restore_len, prompt_len]``) whose state the prefill
        should export, with why. ``chunk_ends`` are absolute end positions of the prefill chunks;
        ``branch_point`` comes from ``tree.find_branch_point`` before the prefill."""
        plan: dict[int, CheckpointKind] = {}

        def add(pos: Optional[int], kind: CheckpointKind) -> None:
            if pos is None:
                return
            pos = self._align(pos)
            if restore_len < pos <= prompt_len:
                plan[pos] = plan.get(pos, CheckpointKind(0)) | kind

        if self.at_chunk_end:
            for end in chunk_ends[:-1] if chunk_ends and chunk_ends[-1] >= prompt_len else chunk_ends:
                add(end, CheckpointKind.CHUNK)
        if self.at_prompt_end:
            add(prompt_len, CheckpointKind.PROMPT_END)
        if self.at_branch_points:
            add(branch_point, CheckpointKind.BRANCH)
        return plan

    def export_candidates(
        self,
        grid: Sequence[int],
        end: int,
        prompt_len: Optional[int],
        branch_point: Optional[int] = None,
    ) -> dict[int, CheckpointKind]:
        """Which of an extend's exported chunk-boundary states to keep, with why. ``grid`` are the
        absolute positions with an exported state (ascending), ``end`` the extent the extend
        reaches, ``prompt_len`` the request's prompt length (None: unknown, taken as reached) and
        ``branch_point`` the one found at match time. At most two: the last grid point if the
        extend reaches the prompt end (so a repeated or fully contained prompt still hits) and
        the grid point at or below the branch point (so requests sharing only that prefix hit)."""
        wanted: dict[int, CheckpointKind] = {}
        if not grid:
            return wanted
        if self.at_prompt_end and (prompt_len is None or end >= prompt_len):
            wanted[grid[-1]] = CheckpointKind.PROMPT_END
        if self.at_branch_points and branch_point is not None:
            below = [g for g in grid if g <= branch_point]
            if below:
                wanted[below[-1]] = wanted.get(below[-1], CheckpointKind(0)) | CheckpointKind.BRANCH
        return wanted

    def decode_checkpoint(self, seq_len: int, advanced: int = 1) -> bool:
        """After a decode step that committed ``advanced`` tokens the sequence has ``seq_len``
        processed tokens: snapshot now? When the step crossed a multiple of the interval. One
        token a step lands on the multiple itself; a speculative verify that accepts several
        tokens jumps over it, and the state then is the one after the step (the slot holds no
        other), kept where a hit can land (a multiple of ``hit_unit``)."""
        if not self.decode_interval or seq_len % self.hit_unit:
            return False
        return seq_len // self.decode_interval > (seq_len - max(1, advanced)) // self.decode_interval

    def generation_end(self, seq_len: int) -> Optional[int]:
        """The turn boundary to keep when a request finishes with ``seq_len`` processed tokens."""
        if not self.at_generation_end:
            return None
        return self._align(seq_len) or None

    def select_recyclable(
        self,
        path: Sequence[Checkpoint],
        is_branch_point: Callable[[Checkpoint], bool],
    ) -> list[Checkpoint]:
        """Checkpoints on one path (shallowest first) no longer worth keeping: intermediates
        (chunk/decode kind, not at a branch point) with a later checkpoint on the same path; then,
        over budget, the shallowest recyclable or plain ones except the deepest and branch points."""
        drop: list[Checkpoint] = []
        if self.recycle_superseded:
            for ck in path[:-1]:
                if ck.kind.recyclable and not is_branch_point(ck):
                    drop.append(ck)
        if self.per_path_budget is not None:
            kept = [c for c in path if c not in drop]
            excess = len(kept) - self.per_path_budget
            for ck in kept[:-1]:
                if excess <= 0:
                    break
                if not is_branch_point(ck):
                    drop.append(ck)
                    excess -= 1
        return drop
