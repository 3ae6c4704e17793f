"""The tree's registry of checkpoints: the only code that adds, flags, lands or drops one.

A checkpoint (:class:`~sglang_k3.cache.node.Checkpoint`) is a KDA state after ``pos`` tokens with
one read-only handle per KDA group, held on the node whose span contains ``pos``. The registry
keeps, besides the nodes' own dicts, every checkpoint by id, the owner of every handle, the ones
whose copy has not landed (invariant 2: not matchable, not evictable) and the running accounts the
budget asks for many times a step: which checkpoints cannot be evicted now (pinned, unlanded, or
under a lock that protects them) and their bytes.

:class:`CheckpointRegistry` is one part of :class:`~sglang_k3.cache.tree.K3RadixTree` (which
inherits it with the radix structure and :class:`~sglang_k3.cache.retention.Retention`); it reads
the structure's nodes and paths and never changes them, except for the ghost a dropped or evicted
checkpoint leaves on its node (:mod:`sglang_k3.cache.ghosts`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_k3.cache.actions import DropReason, Freed
from sglang_k3.cache.ghosts import Ghost, GhostReason, StateClass
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.results import Pin


class CheckpointBusy(RuntimeError):
    """Raised when asked to drop a checkpoint that is pinned or whose copy has not landed."""


class CheckpointRegistry:
    def _reset_registry(self) -> None:
        self._ckpts: dict[int, Checkpoint] = {}
        self._handle_owner: dict[int, Checkpoint] = {}
        self._pending: set[int] = set()
        self._stuck: set[int] = set()  # ids of checkpoints that cannot be evicted now
        self._stuck_bytes = 0
        self._stuck_free: set[int] = set()  # of _stuck, those on an unlocked node (stuck_kv_tokens)
        self.stats.checkpoints = 0
        self.stats.checkpoint_bytes = 0

    def checkpoint_count(self) -> int:
        return len(self._ckpts)

    def checkpoint_bytes(self) -> int:
        return self.stats.checkpoint_bytes

    def evictable_checkpoint_bytes(self) -> int:
        """Bytes of the checkpoints :meth:`checkpoint_evictable` would let go now. Kept up to
        date at every pin, lock, landing and drop (:meth:`_restat`), not summed per call: the
        unified budget asks it each time SGLang asks the KV allocator its size, several times a
        scheduler step, over up to thousands of checkpoints."""
        return self.stats.checkpoint_bytes - self._stuck_bytes

    def _restat(self, ck: Checkpoint) -> None:
        """Re-file ``ck`` as evictable or stuck after one of its conditions changed."""
        stuck = ck.node is not None and not self.checkpoint_evictable(ck)
        if stuck and ck.id not in self._stuck:
            self._stuck.add(ck.id)
            self._stuck_bytes += ck.nbytes
        elif not stuck and ck.id in self._stuck:
            self._stuck.remove(ck.id)
            self._stuck_bytes -= ck.nbytes
        if stuck and not ck.node.lock_ref:  # type: ignore[union-attr]
            self._stuck_free.add(ck.id)
        else:
            self._stuck_free.discard(ck.id)

    def checkpoints(self) -> list[Checkpoint]:
        return list(self._ckpts.values())

    def stuck_kv_tokens(self) -> int:
        """Of :meth:`evictable_size`, the KV slots no eviction can free now: the unlocked path up
        to each checkpoint that cannot go yet (its copy has not landed, or it is pinned). Eviction
        takes a leaf's KV only with its checkpoints, so this KV stays until they can go; a caller
        that admits work against the evictable size must not count it (SGLang's prefill admission
        did, then failed its allocation with "Out of memory" and stopped the server).

        Summed once per node holding a stuck checkpoint, over unlocked nodes only
        (``_stuck_free``, kept by :meth:`_restat`): those on a running request's locked path, most
        of the stuck ones, hold KV that is protected already. SGLang asks for the evictable size
        several times a step. With 128 running requests and 16 unlanded copies (three checkpoints
        each) a call costs 19 us; iterating every stuck checkpoint cost 78 us."""
        if not self._stuck_free:  # the common case: SGLang asks hundreds of times a step
            return 0
        counted: dict[int, int] = {}
        for holder in {self._ckpts[cid].node for cid in self._stuck_free}:
            for n in self._path(holder):  # type: ignore[arg-type]
                if n.lock_ref:
                    break  # ancestors of a locked node are locked too
                slots = self._slots(n)
                if n is holder and n.is_leaf:  # a leaf's KV past its last checkpoint can be trimmed
                    slots = min(slots, self._keep_end(n) - n.start)
                counted[n.id] = max(counted.get(n.id, 0), slots)
        return sum(counted.values())

    def add_checkpoint(
        self,
        node: Node,
        pos: int,
        handles: Sequence[Optional[int]],
        nbytes: int,
        kind: CheckpointKind = CheckpointKind.CHUNK,
        ready: bool = False,
    ) -> Optional[Checkpoint]:
        """Register (copy or donate) a checkpoint after ``pos`` tokens on the path to ``node``.

        ``handles[g]`` is group g's slot, or None when that group registers later
        (``attach_group_handle``). Returns None when the tree already has a checkpoint at ``pos``:
        the caller keeps (frees) its handles. Not matchable until ``mark_ready``/``commit_step``
        unless ``ready`` (use only when the write is known to have landed)."""
        self._check_attached(node)
        if pos <= 0 or pos % self.hit_unit or pos > node.end:
            raise ValueError(
                f"checkpoint position {pos} must be a positive multiple of "
                f"{self.hit_unit} within the path (<= {node.end})"
            )
        if len(handles) != self.num_groups:
            raise ValueError(f"expected {self.num_groups} group handles, got {len(handles)}")
        holder = node
        while not (holder.start < pos <= holder.end):
            holder = holder.parent  # type: ignore[assignment]
        if pos in holder.checkpoints:
            return None
        for h in handles:
            if h is not None and h in self._handle_owner:
                raise ValueError(f"handle {h} is already held by the tree")
        ck = Checkpoint(
            id=self._new_id(),
            pos=pos,
            handles=list(handles),
            nbytes=nbytes,
            kind=kind,
            node=holder,
            ready=ready,
            last_access=self._tick(),
        )
        holder.checkpoints[pos] = ck
        holder.ghosts.pop(pos, None)  # a state is back where one was let go
        if self.reuse is not None and kind & CheckpointKind.GEN_END:
            self.reuse.observe(StateClass.TURN)  # the reference class: is a turn end used again?
            ck.watch = StateClass.TURN
        self._ckpts[ck.id] = ck
        for h in ck.held_handles():
            self._handle_owner[h] = ck
        if not ready:
            self._pending.add(ck.id)
        self.stats.checkpoints += 1
        self.stats.checkpoint_bytes += nbytes
        self._restat(ck)
        return ck

    def attach_group_handle(self, ck: Checkpoint, group: int, handle: int) -> None:
        if ck.id not in self._ckpts or ck.handles[group] is not None or handle in self._handle_owner:
            raise ValueError("cannot attach: checkpoint gone, group already set, or handle held")
        ck.handles[group] = handle
        self._handle_owner[handle] = ck

    def mark_ready(self, ck: Checkpoint) -> None:
        """The copy/donation into ``ck``'s handles has landed: it becomes matchable."""
        ck.ready = True
        self._pending.discard(ck.id)
        self._restat(ck)

    def commit_step(self) -> int:
        """All checkpoints registered so far have landed (call after the step's copies sync)."""
        n = 0
        for cid in list(self._pending):
            ck = self._ckpts.get(cid)
            if ck is not None:
                ck.ready = True
                self._restat(ck)
                n += 1
        self._pending.clear()
        return n

    def checkpoint_of(self, handle: int) -> Optional[Checkpoint]:
        """The checkpoint that holds ``handle`` (any group), or None."""
        return self._handle_owner.get(handle)

    def checkpoint_evictable(self, ck: Checkpoint) -> bool:
        """Not pinned, landed, in the tree, and not protected by a lock on its path."""
        if ck.pins or not ck.ready or ck.node is None:
            return False
        return ck.node.lock_ref == 0 or not self.lock_protects_checkpoints

    def drop_checkpoint(self, ck: Checkpoint, reason: DropReason = DropReason.DROPPED) -> Freed:
        """Remove one boundary, every group at once; its KV stays (pass-through node)."""
        if ck.pins > 0 or not ck.ready:
            raise CheckpointBusy(f"checkpoint at {ck.pos} is pinned or its copy has not landed")
        assert ck.node is not None
        path = None
        if reason is DropReason.EVICTED and self.capture_evicted and not ck.superseded:
            path = self.path_prefix(ck.node, ck.pos)
        if reason in (DropReason.EVICTED, DropReason.RECYCLED):
            ck.node.ghosts[ck.pos] = Ghost(
                GhostReason.EVICTED if reason is DropReason.EVICTED else GhostReason.DROPPED, ck.watch
            )
        del ck.node.checkpoints[ck.pos]
        del self._ckpts[ck.id]
        handles = ck.held_handles()
        for h in handles:
            del self._handle_owner[h]
        ck.node = None  # detached; ck.handles keeps the record of what was handed back
        self._restat(ck)
        self.stats.checkpoints -= 1
        self.stats.checkpoint_bytes -= ck.nbytes
        freed = Freed()
        freed.add_checkpoint(handles, ck.pos, ck.nbytes, reason, ck.kind, path)
        return freed

    def path_checkpoints(self, node: Node) -> list[Checkpoint]:
        """Checkpoints on the path to ``node``, shallowest first."""
        self._check_attached(node)
        out: list[Checkpoint] = []
        for n in self._path(node):
            out.extend(sorted(n.checkpoints.values(), key=lambda c: -c.pos))
        return out[::-1]

    # ------------------------------------------------------------------ pins (invariant 1)
    def pin_hit(self, ck: Checkpoint) -> Pin:
        """An admitted match restores from ``ck``: count the hit (evidence it is worth keeping; it
        serves more than a repeat that may never come, so a superseded mark goes), pin it (all
        groups at once) and lock the KV path under it until the copy-on-write has landed."""
        ck.hits += 1
        ck.superseded = False
        if ck.deferred:  # the rule that let it go was wrong here: it is a state like any other now
            ck.deferred = False
            self.stats.deferred_hits += 1
        if ck.watch >= 0:
            if self.reuse is not None:
                self.reuse.reused(ck.watch, self.saved_flops(ck))
            ck.watch = -1  # a state counts once
        ck.pins += 1
        self.inc_lock_ref(ck.node)  # type: ignore[arg-type]
        self._restat(ck)
        return Pin(checkpoint=ck, node=ck.node)  # type: ignore[arg-type]

    def release_pin(self, pin: Pin) -> None:
        """The COW out of the pinned checkpoint has landed: it may be evicted again."""
        if pin.released:
            raise ValueError("pin released twice")
        if pin.checkpoint.pins <= 0:
            raise AssertionError("checkpoint pin count would go negative")
        pin.released = True
        pin.checkpoint.pins -= 1
        self.dec_lock_ref(pin.node)
        self._restat(pin.checkpoint)

    # ------------------------------------------------------------------ flags
    def mark_branch(self, ck: Checkpoint) -> None:
        """``ck`` serves forks at a branch point: flag it ``BRANCH`` (never recycled by the per-path
        cap, never dropped as superseded) and clear a superseded mark."""
        ck.kind |= CheckpointKind.BRANCH
        ck.superseded = False
        ck.deferred = False

    def mark_superseded(self, ck: Checkpoint) -> None:
        """``ck`` is kept only for a repeat of its prompt: eviction prices it at 0 until it is hit."""
        ck.superseded = True

    def mark_deferred(self, ck: Checkpoint) -> None:
        """A placement rule let ``ck`` go while memory was free: it stays until memory is short
        and then goes first (:meth:`~sglang_k3.cache.retention.Retention.let_go`)."""
        ck.deferred = True
        self.stats.deferred_checkpoints += 1
