"""Retention: which KV and checkpoints the cache keeps, and in what order the rest goes. Every
rule that prices, wants, ranks, evicts, trims, recycles or drops lives here.

**The order** candidates go in (utility: recency and prefill FLOPs saved per byte; what the
waiting queue wants last) is :func:`~sglang_k3.cache.ranking.rank`, in ``ranking.py`` with the
reasons for it; this module decides what is a candidate and what each is worth.

**Two resources, one order.** KV tokens go from unlocked leaves only; KV past a leaf's last
checkpoint is dead for restores and goes first; a leaf whose KV goes loses its checkpoints.
Dropping a checkpoint keeps its KV (the node becomes a pass-through). For a budget both draw from
(:meth:`Retention.evict_ranked`) KV and checkpoints compete on the same price.

**One state per turn.** When a request's generation-end state lands, the states it placed earlier
leave the tree unless there is evidence of forks there (:meth:`Retention.drop_superseded`); the one
an identical prompt would restore from stays, superseded, priced at 0.

**Learned exceptions.** That rule and the recycling of superseded chunk ends were measured on
linear conversations. Where the traffic comes back inside finished prompts (many questions over
the same documents), the states they drop are what later forks restore from. So each state they
would drop leaves a ghost, and with a :class:`~sglang_k3.cache.ghosts.ReuseLearner` the tree keeps
such states while their class has saved as much prefill per state, counting ghost hits, as the
turn ends the cache always keeps (:meth:`Retention.judge`; ``--k3-no-adaptive-retention`` turns it
off).

:class:`Retention` is one part of :class:`~sglang_k3.cache.tree.K3RadixTree` (with the radix
structure and the :class:`~sglang_k3.cache.registry.CheckpointRegistry`): it reads the structure,
and changes checkpoints only through the registry and KV only through the structure's trims.
Torch-free.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from sglang_k3.cache.actions import DropReason, Freed
from sglang_k3.cache.ghosts import StateClass
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.ranking import Candidate, rank


class Retention:
    def _reset_wants(self) -> None:
        # The waiting queue's last refresh: a run of touch() calls with nothing else between them
        # (SGLang touches the whole queue in one loop). It started at clock _wanted_since; a
        # checkpoint touched in it is wanted by a waiting request (Checkpoint.wanted).
        self._wanted_since = 1 << 62
        self._last_touch = -1

    # ------------------------------------------------------------------ wants (the waiting queue)
    def touch(self, key: Sequence[int]) -> int:
        """Make ``key``'s cached path and the checkpoint a match would restore from the most
        recently used, as a lookup would, without pinning or counting a lookup (a waiting
        request's refresh: it is about to be matched, so what it will hit should not be evicted
        first). Returns the restore length it would get.

        The checkpoint also becomes *wanted*: eviction takes it only after everything no waiting
        request wants (:func:`rank`). Touches with nothing else between
        them are one refresh of the queue, tail first: the first touch of a new run ends the last
        refresh's wants (those requests were admitted, or left), and within a run the later touch
        (nearer the queue's head) is kept longer. An admitted match does not end a want: other
        queued requests may restore from the same checkpoint (a shared system prompt's), and the
        refresh that follows the admission knows. Clearing it there let a batch's first admission
        expose the shared state to the batch's own allocations: with fp32 checkpoints under the
        live A/B's pressure budget, whole batches of four then missed the system prompt (5,120
        cached tokens of 21,760, against 8,276 when the want holds).

        The shared states below the one it would restore from (branch points on its path) become
        wanted too: if that one goes, the request restores there. Otherwise such a state, older
        than every turn end above it, was evicted first, and the queued turns whose own states
        went after it missed their system prompt as well."""
        if self._clock != self._last_touch:
            self._wanted_since = self._clock + 1
            self.stats.waiting_refreshes += 1
        path, _, _, best, _ = self._lookup(key)
        self._last_touch = self._clock
        if best is None:
            return 0
        best.wanted = self._clock
        for node in path:  # the shared states it falls back to if ``best`` goes
            for ck in node.checkpoints.values():
                if ck.pos < best.pos and self.is_branch_point(ck):
                    ck.wanted = self._clock  # a later touch is nearer the queue's head: it wins
        return best.pos

    def end_wants(self) -> None:
        """No request waits (the queue emptied): the last refresh's wants end (a request of it
        that left without a match, e.g. aborted, would otherwise keep its checkpoint wanted)."""
        self._wanted_since = 1 << 62

    def wanted(self, ck: Checkpoint) -> int:
        """The clock of the touch by which a waiting request of the last refresh wants ``ck``,
        0 when none does."""
        return ck.wanted if ck.wanted >= self._wanted_since else 0

    # ------------------------------------------------------------------ evidence of forks
    def is_branch_point(self, ck: Checkpoint) -> bool:
        """Placed at a fork (``BRANCH``), or where two or more live paths part. A child that is a
        leaf with no lock and no checkpoint (or deferred ones only: :meth:`let_go`) is a dead
        stub, not a path: its KV can serve no restore (e.g. the tail a prompt leaves past its last
        state, which the same request's longer sequence forks off inside a page or replay
        symbol), so it does not make a fork."""
        n = ck.node
        if ck.kind & CheckpointKind.BRANCH:
            return True
        if n is None or ck.pos != n.end:
            return False
        live = sum(
            1
            for c in n.children.values()
            if c.children or c.lock_ref or any(not q.deferred for q in c.checkpoints.values())
        )
        return live >= 2

    # ------------------------------------------------------------------ pricing
    def saved_flops(self, ck: Checkpoint) -> float:
        """FLOPs a hit at ``ck`` saves over the next-best earlier checkpoint on its path."""
        prev = 0
        for n in self._path(ck.node):  # type: ignore[arg-type]
            earlier = [q for q, c in n.checkpoints.items() if q < ck.pos and not c.deferred]
            if earlier:
                prev = max(earlier)
                break
        return self.policy.flops(prev, ck.pos)

    def expected_saving(self, ck: Checkpoint) -> float:
        """What eviction prices a checkpoint by: the FLOPs one hit saves (:meth:`saved_flops`)
        times ``1 + log2(1 + hits)``. Past hits are the evidence of future ones: a shared system
        prompt's state, hit by every conversation, is worth keeping over a turn end no one has
        come back to, though one hit on it saves less (the frequency term of GreedyDual-Size-
        Frequency, Cherkasova, HP Labs HPL-98-69, 1998). Logarithmic, not linear: on the
        conversation trace a linear ``1 + hits`` took the fixed 64-slot pool (``k3-fixed``)
        from 0.058 to 0.045 at 20-80 GiB, for +0.009 at 40 GiB unified;
        ``benchmarks/results/trace_replay`` has the measured default. Recency stays the other
        term (:func:`rank`), so a once-hot state that went cold still
        ages out.

        A superseded state (kept only for a repeat of its prompt, see
        :meth:`drop_superseded`) is priced at 0 until a hit clears the mark: it
        competes on recency alone, so it goes before any priced state of about its age, but a
        prompt regenerated a few seconds after its answer still finds it while states that went
        cold long ago go first. Strictly first (the rule before) lost nearly every repeat state
        before its regeneration came: on the fork-heavy generator's chat mix (docs/results.md, "Trace
        replay"; ``benchmarks/results/trace_replay_fork_chat``) k3 then trailed Marconi at
        10-40 GiB; the conversation trace moved by less than 0.001."""
        if ck.superseded:
            return 0.0
        if ck.judged and not ck.hits and self.reuse is not None:
            # Kept past its placement rule and not used yet: it promises what its class has saved
            # per state so far (ghost hits counted), not the whole span it could save. Priced by
            # that span, such states crowded MLA KV out at tight budgets (conversation trace,
            # chunk 2048, 10 GiB: 0.0435 -> 0.0406); priced so, 0.0435 and the kept states still
            # serve the forks that come back (docs/results.md, "Retention suite").
            return min(self.saved_flops(ck), self.reuse.value(StateClass.of(ck.kind)))
        return self.saved_flops(ck) * (1 + math.log2(1 + ck.hits))

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int = 0, num_bytes: int = 0, spare_wanted: bool = False) -> Freed:
        """Free at least ``num_bytes`` of checkpoints and ``num_tokens`` of KV where possible;
        with ``spare_wanted`` no checkpoint a waiting request wants goes (room for a new one)."""
        freed = Freed()
        if num_bytes > 0:
            freed.extend(self._evict_checkpoints(num_bytes, spare_wanted))
        if num_tokens > 0:
            freed.extend(self._evict_kv(num_tokens))
        return freed

    def evict_checkpoint(self, ck: Checkpoint) -> Freed:
        """Drop ``ck`` as an eviction (every group; its KV stays) and count it. A deferred state
        goes as its placement rule would have let it go (a recycled state: no demotion to a lower
        tier, a ghost of a dropped state)."""
        if ck.deferred:
            self.stats.recycled_checkpoints += 1
            return self.drop_checkpoint(ck, DropReason.RECYCLED)
        self.stats.evicted_wanted_checkpoints += bool(self.wanted(ck))
        freed = self.drop_checkpoint(ck, DropReason.EVICTED)
        self.stats.evicted_checkpoints += 1
        self.stats.evicted_checkpoint_bytes += freed.checkpoint_bytes
        return freed

    def _evict_checkpoints(self, need: int, spare_wanted: bool = False) -> Freed:
        freed, got = Freed(), 0
        cands = [
            Candidate(c, c.last_access, self.expected_saving(c), c.nbytes, self.wanted(c), c.deferred)
            for c in self._ckpts.values()
            if self.checkpoint_evictable(c) and not (spare_wanted and self.wanted(c))
        ]
        for cand in rank(cands, self.policy.alpha):
            if got >= need:
                break
            f = self.evict_checkpoint(cand.obj)  # type: ignore[arg-type]
            got += f.checkpoint_bytes
            freed.extend(f)
        return freed

    def _keep_end(self, leaf: Node) -> int:
        """KV a leaf must keep: up to its last checkpoint, rounded up to a whole page."""
        if not leaf.checkpoints:
            return leaf.start
        p = self.page_size
        return min(leaf.end, -(-max(leaf.checkpoints) // p) * p)

    def _evict_kv(self, need: int) -> Freed:
        freed = Freed()
        while len(freed.kv_indices) < need:
            leaves = [n for n in self._leaves() if n.lock_ref == 0]
            if self._trim_dead_tails(leaves, freed, lambda: len(freed.kv_indices) >= need):
                continue
            whole = [n for n in leaves if all(self.checkpoint_evictable(c) for c in n.checkpoints.values())]
            if not whole:
                break
            cands = [
                Candidate(
                    n,
                    n.last_access,
                    sum(self.expected_saving(c) for c in n.checkpoints.values()),
                    self.policy.kv_bytes(len(n.key)) + n.checkpoint_bytes(),
                    max((self.wanted(c) for c in n.checkpoints.values()), default=0),
                    bool(n.checkpoints) and all(c.deferred for c in n.checkpoints.values()),
                )
                for n in whole
            ]
            for cand in rank(cands, self.policy.alpha):
                if len(freed.kv_indices) >= need:
                    break
                leaf: Node = cand.obj  # type: ignore[assignment]
                for ck in list(leaf.checkpoints.values()):
                    freed.extend(self.evict_checkpoint(ck))
                freed.extend(self._trim_leaf(leaf, leaf.start))
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def evict_ranked(
        self,
        need_bytes: int,
        keep_checkpoints: int = 0,
        group: Optional[Callable[[Checkpoint], int]] = None,
        spare_wanted: bool = False,
    ) -> Freed:
        """Free about ``need_bytes`` of KV and checkpoints together, least valuable first, for a
        budget both draw from. KV past a leaf's last checkpoint is worth nothing (no restore can
        use it) and goes first. Then checkpoints compete, each priced by the prefill FLOPs a hit
        on it saves per byte it keeps alive: its own bytes, plus, for the last checkpoint of an
        unlocked leaf, the leaf's KV that dropping it lets go. So the KV of a cold path can lose
        to a hot checkpoint and the reverse (with recency: the ``alpha`` blend of
        :func:`rank`). ``keep_checkpoints``: never take the checkpoint
        count below this (a floor). ``group``: checkpoints that only free memory together (the
        sub-slots of one block of a unified budget) compete as one candidate and go together, so
        freeing a block takes the cheapest block's checkpoints, not the cheapest checkpoints of
        many blocks. ``spare_wanted``: no checkpoint a waiting request wants goes (the room is
        for a new checkpoint, whose use is a guess: see :meth:`CacheLifecycle.evict_until`)."""
        freed = Freed()
        leaves = [n for n in self._leaves() if n.lock_ref == 0]
        self._trim_dead_tails(leaves, freed, lambda: self.policy.kv_bytes(len(freed.kv_indices)) >= need_bytes)
        got = self.policy.kv_bytes(len(freed.kv_indices))
        cands = []
        if got < need_bytes and self.checkpoint_count() > keep_checkpoints:
            if group is None:
                cands = [self._candidate([c]) for c in self._ckpts.values() if self.checkpoint_evictable(c)]
            else:
                by: dict[int, list[Checkpoint]] = {}
                for c in self._ckpts.values():
                    by.setdefault(group(c), []).append(c)
                cands = [self._candidate(g) for g in by.values() if all(map(self.checkpoint_evictable, g))]
        if spare_wanted:
            cands = [c for c in cands if not c.wanted]
        for cand in rank(cands, self.policy.alpha):
            if got >= need_bytes or self.checkpoint_count() <= keep_checkpoints:
                break
            for ck in cand.obj:  # type: ignore[attr-defined]
                node = ck.node
                if node is None or self.checkpoint_count() <= keep_checkpoints:
                    continue
                f = self.evict_checkpoint(ck)
                f.extend(self._trim_up(node))  # the KV it kept alive
                got += f.checkpoint_bytes + self.policy.kv_bytes(len(f.kv_indices))
                freed.extend(f)
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def _candidate(self, cks: list[Checkpoint]) -> Candidate:
        """Checkpoints that go together, priced as one: the FLOPs their hits save over the bytes
        they keep alive (their own and the KV only they hold), at their newest access."""
        if len(cks) == 1:  # the common case (a block holds one checkpoint): the same values, no generators
            c = cks[0]
            return Candidate(
                cks,
                c.last_access,
                self.expected_saving(c),
                c.nbytes + self._kv_freed_with(c),
                self.wanted(c),
                c.deferred,
            )
        return Candidate(
            cks,
            max(c.last_access for c in cks),
            sum(self.expected_saving(c) for c in cks),
            sum(c.nbytes + self._kv_freed_with(c) for c in cks),
            max(self.wanted(c) for c in cks),
            all(c.deferred for c in cks),
        )

    def rank_checkpoint_groups(self, groups: Sequence[list[Checkpoint]]) -> list[list[Checkpoint]]:
        """``groups`` (each a set of checkpoints that only free memory together, e.g. one state
        slot's blocks) whose checkpoints are all evictable, least valuable first, priced as
        :meth:`evict_ranked` prices them."""
        ok = [g for g in groups if g and all(map(self.checkpoint_evictable, g))]
        return [c.obj for c in rank([self._candidate(g) for g in ok], self.policy.alpha)]  # type: ignore[misc]

    def _kv_freed_with(self, ck: Checkpoint) -> int:
        """KV bytes that dropping ``ck`` lets go: the tail of an unlocked leaf past the checkpoint
        before it (or the whole leaf), when ``ck`` is the leaf's last checkpoint."""
        n = ck.node
        if n is None or not n.is_leaf or n.lock_ref:
            return 0
        # deferred states are counted as gone (they go first), as the rule that let them go meant
        live = [p for p, c in n.checkpoints.items() if not c.deferred or c is ck]
        if ck.pos != max(live):
            return 0
        lower = [p for p in live if p < ck.pos]
        return self.policy.kv_bytes(ck.pos - (max(lower) if lower else n.start))

    # ------------------------------------------------------------------ dead KV
    def trim_dead_tail(self, leaf: Node) -> Freed:
        """Free an unlocked leaf's KV past its last checkpoint (the whole leaf when it has none):
        KV no restore can use. Nothing when ``leaf`` is locked, not a leaf, or has no such KV."""
        self._check_attached(leaf)
        freed = Freed()
        if leaf is self.root or not leaf.is_leaf or leaf.lock_ref or self._keep_end(leaf) >= leaf.end:
            return freed
        freed.extend(self._trim_leaf(leaf, self._keep_end(leaf)))
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def trim_dead_tails(self, enough: Callable[[], bool]) -> Freed:
        """Every unlocked leaf's KV past its last checkpoint, least recently used leaf first, until
        ``enough()`` (:meth:`trim_dead_tail` for all leaves)."""
        freed = Freed()
        self._trim_dead_tails([n for n in self._leaves() if n.lock_ref == 0], freed, enough)
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def _trim_up(self, node: Node) -> Freed:
        """After ``node`` lost a checkpoint: its dead tail, and when that removes it, its parent's
        while the parent became a leaf with KV past its last checkpoint, up to the next state or
        fork. A turn's path is a chain of nodes (split where later turns and exports matched), so
        dropping its turn-end state frees the whole chain. Counting only the last node's tail, an
        eviction that asked for ~600 KV tokens took five turn ends and freed ~1,600 (the live
        A/B's ``multiturn`` under ``--pressure``), the rest trimmed a round later, uncounted."""
        freed = Freed()
        while node.parent is not None and node.is_leaf and node.lock_ref == 0 and self._keep_end(node) < node.end:
            parent, removed = node.parent, self._keep_end(node) == node.start
            freed.extend(self._trim_leaf(node, self._keep_end(node)))
            if not removed or parent is self.root:
                break
            node = parent
        return freed

    def _trim_dead_tails(self, leaves: list[Node], freed: Freed, enough: Callable[[], bool]) -> bool:
        """KV past a leaf's last checkpoint cannot serve a restore: trim it, least recently used
        leaf first, into ``freed`` until ``enough()``. Returns whether any leaf had such KV."""
        dead = sorted((n for n in leaves if self._keep_end(n) < n.end), key=lambda n: n.last_access)
        for leaf in dead:
            if enough():
                break
            freed.extend(self._trim_leaf(leaf, self._keep_end(leaf)))
        return bool(dead)

    # ------------------------------------------------------------------ recycling
    def recycle_path(self, node: Node, policy: "PlacementPolicy") -> Freed:  # noqa: F821
        """Drop intermediate checkpoints on ``node``'s path that ``policy`` no longer wants
        (called while the request that owns ``node`` runs)."""
        freed = Freed()
        live = [c for c in self.path_checkpoints(node) if not c.deferred]
        for ck in policy.select_recyclable(live, self.is_branch_point):
            if ck.pins == 0 and ck.ready and not self.judge(ck):
                freed.extend(self.let_go(ck))
        self.stats.recycled_checkpoints += freed.checkpoints
        return freed

    def let_go(self, ck: Checkpoint) -> Freed:
        """A placement rule (recycling, one state per turn) lets ``ck`` go. When memory is short
        it goes now. When the budget has memory nobody holds (``has_slack``), it stays: matchable
        like any state, but deferred, first to go at the next shortage (:func:`rank`), so the
        rest of the cache is what it would have been had it gone. A rule that guesses a state
        is useless costs nothing while memory is free (traffic that fits, a budget not yet full).
        Where memory runs short anyway, deferred states go at the next shortage: on the suite's
        chat family (docs/results.md, "Retention suite") this cut the tokens lost to dropped
        states at 10 GiB from 105k to 95k of 33M, not to 0. A hit clears the mark."""
        if ck.deferred:
            return Freed()
        if self.has_slack is not None and self.has_slack():
            self.mark_deferred(ck)
            return Freed()
        return self.drop_checkpoint(ck, DropReason.RECYCLED)

    # ------------------------------------------------------------------ learned exceptions
    def judge(self, ck: Checkpoint) -> bool:
        """A placement rule (recycling a superseded chunk end, one state per turn) would let ``ck``
        go: keep it instead? Yes when the tree has a reuse learner and ``ck``'s class of state
        has been used again at least as often as the turn-end states, which the cache always
        keeps (:meth:`~sglang_k3.cache.ghosts.ReuseLearner.keeps`); a state kept so is priced as
        any other and judged once. Either way its first use, as a hit or as a hit on the ghost it
        leaves, teaches the learner. The rules were measured on linear conversations, where a
        state inside a finished turn is rarely restored again; on traffic that forks inside
        earlier prompts (documents shared by many questions) such states are what later forks
        restore from, and there the learner keeps them (docs/results.md, "Retention suite")."""
        if self.reuse is None:
            return False
        if ck.judged:
            return True
        cls = StateClass.of(ck.kind)
        if ck.watch == cls:
            return False  # judged before and not kept (a repeat state left superseded)
        self.reuse.observe(cls)
        ck.watch = cls
        if self.reuse.keeps(cls):
            ck.judged = True
            return True
        return False

    # ------------------------------------------------------------------ one state per turn
    def drop_superseded(
        self,
        placed: list[Checkpoint],
        restored: Optional[Checkpoint],
        up_to: int,
        repeat: bool,
        prompt_len: Optional[int],
        keep_repeat_state: bool,
    ) -> Freed:
        """One state per turn, once a request's generation-end state (after ``up_to`` tokens) is in
        the tree. A request leaves states at its chunk ends, its prompt end (two: the exported grid
        point below it, so an identical prompt hits, and the prompt end itself) and its generation
        end (``placed``, plus the one it ``restored`` from). The next turn of a conversation
        extends the whole sequence and matches the generation end, so the earlier ones save
        nothing over it for that turn; they would serve only a request that forks between them
        and the generation end. So they go, unless there is evidence that such forks happen there:
        the state was hit (by another request than this one), it sits where live paths part
        (:meth:`is_branch_point`), it was placed at a fork (``BRANCH``), or the request itself
        ``repeat``-ed a fully cached prompt (then its prompt states stay, so the next regeneration
        of that prompt hits). With ``keep_repeat_state`` the state an identical prompt would
        restore from stays too, superseded: priced at 0 (:meth:`expected_saving`). Measured on the
        conversation trace in ``benchmarks/results/trace_replay``; the placement flag
        ``drop_superseded`` turns the rule off."""
        freed = Freed()
        own = [(ck, 0) for ck in placed]
        if restored is not None:
            own.append((restored, 1))  # its one hit was this request, which went on past it
        for ck, own_hits in sorted(own, key=lambda c: -c[0].pos):  # deepest first: a stub it empties is no fork
            if (
                ck.node is None
                or ck.deferred
                or ck.pos >= up_to
                or ck.hits > own_hits
                or ck.pins
                or not ck.ready
                or self.is_branch_point(ck)
                or (repeat and ck.kind & CheckpointKind.PROMPT_END)
            ):
                continue
            if self.judge(ck):
                continue  # its class is reused: kept, priced as any state
            if ck.kind & CheckpointKind.PROMPT_END and self._repeat_state(ck, placed, prompt_len, keep_repeat_state):
                self.mark_superseded(ck)  # kept for a repeat of this prompt, priced at 0 (recency alone)
                continue
            freed.extend(self.let_go(ck))
        self.stats.recycled_checkpoints += freed.checkpoints
        return freed

    @staticmethod
    def _repeat_state(
        ck: Checkpoint, placed: Sequence[Checkpoint], prompt_len: Optional[int], keep_repeat_state: bool
    ) -> bool:
        """The state an identical or contained prompt restores from: the deepest one strictly
        inside the prompt (a lookup is capped one token short of the key, so the prompt-end state
        itself never serves the same prompt again)."""
        if not keep_repeat_state or prompt_len is None or ck.pos >= prompt_len:
            return False
        return not any(c.node is not None and not c.deferred and ck.pos < c.pos < prompt_len for c in placed)

    def keep_as_branch_state(self, restored: Optional[Checkpoint], branch_point: Optional[int]) -> None:
        """A request forks off the tree at ``branch_point``, and its extend exported no state
        between its restore point and that fork (it restored less than one grid step below it):
        the state it ``restored`` from, inside the node the fork splits, is then the deepest one
        before the fork, the one every later fork there restores from. Flag it a branch state, as
        the exported one would have been, so that the turn ends of the requests sharing it do not
        drop it as superseded (:meth:`drop_superseded`) and the per-path cap does not recycle it."""
        if (
            restored is None
            or restored.node is None
            or branch_point is None
            or restored.pos >= branch_point  # at the fork itself: is_branch_point judges it
        ):
            return
        self.mark_branch(restored)
