"""The lifecycle's eviction verbs: what the server's allocators and the unified budget call when
memory is short (:meth:`EvictionVerbs.evict`, :meth:`~EvictionVerbs.evict_until`,
:meth:`~EvictionVerbs.evict_handles`, :meth:`~EvictionVerbs.rank_handle_groups`). Each asks the
tree's retention rules (:mod:`sglang_k3.cache.retention`) what goes, in the order of
:mod:`sglang_k3.cache.ranking`, and carries out what comes back through the action executor
(demotions first, then frees). Part of :class:`~sglang_k3.cache.lifecycle.CacheLifecycle` (a
mixin: it reads the lifecycle's tree and executor). Torch-free."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from sglang_k3.cache.actions import Freed
from sglang_k3.cache.node import Checkpoint


class EvictionVerbs:
    def _apply(self, freed: Freed) -> Freed:
        """Carry out what the tree gave back (:class:`~sglang_k3.cache.actions.ActionExecutor`):
        demotions first, then checkpoint handles to the store and KV to the KV pool."""
        return self.executor.run(freed)

    def evict(self, num_tokens: int = 0, num_bytes: int = 0, spare_wanted: bool = False) -> Freed:
        """Free at least ``num_bytes`` of checkpoints and ``num_tokens`` of KV where possible
        (``spare_wanted``: as in :meth:`evict_until`)."""
        if num_bytes > 0:
            self._release_done_pins()
        return self._apply(self.tree.evict(num_tokens=num_tokens, num_bytes=num_bytes, spare_wanted=spare_wanted))

    def evict_handles(self, handles: Sequence[int]) -> Freed:
        """Evict exactly the checkpoints holding ``handles`` (e.g. the ones in a block the host
        needs back), all or nothing: if any of them is pinned or its copy has not landed, none
        goes."""
        cks = self._owners(handles)
        if any(not self.tree.checkpoint_evictable(ck) for ck in cks):
            return Freed()
        self._release_done_pins()
        freed = Freed()
        for ck in cks:
            freed.extend(self.tree.evict_checkpoint(ck))
        return self._apply(freed)

    def _owners(self, handles: Sequence[int]) -> list[Checkpoint]:
        """The checkpoints holding ``handles``, each once (a checkpoint may hold several)."""
        cks = {id(ck): ck for ck in (self.tree.checkpoint_of(h) for h in handles) if ck is not None}
        return list(cks.values())

    def rank_handle_groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]:
        """Of ``groups`` of checkpoint handles (each freeing memory only as a whole, e.g. the
        handles in one state slot's blocks), those :meth:`evict_handles` can take now, least
        valuable first by the tree's price of their checkpoints."""
        owners = [self._owners(hs) for hs in groups]
        return [[h for ck in g for h in ck.held_handles()] for g in self.tree.rank_checkpoint_groups(owners)]

    def evict_until(
        self,
        done: Callable[[], bool],
        step_bytes: int,
        keep_checkpoints: int = 0,
        group: Optional[Callable[[Checkpoint], int]] = None,
        spare_wanted: bool = False,
    ) -> Freed:
        """For a budget KV and checkpoints share: evict the least valuable of both, about
        ``step_bytes`` at a time (:meth:`K3RadixTree.evict_ranked`; ``group`` makes checkpoints
        that share a block go together), executing each batch's frees, until ``done()`` says the
        memory asked for is there or nothing more can go.

        ``spare_wanted``: no checkpoint a waiting request wants goes. Room for a new checkpoint
        asks this. A queued request's want is a known next use; a new state's use is a guess
        (a prompt end is superseded a few decode steps later; a generation end serves a next
        turn not yet queued, so it comes after every queued one). Evicting the known for the
        guess is what Belady's MIN never does: it bypasses the new one instead. Seen on the live
        A/B's ``multiturn`` under ``--pressure``: the prompt-end states of the running batch
        evicted the turn-end states of the next queued turns, which then missed."""
        total = Freed()
        if done():
            return total
        self._release_done_pins()
        while not done():
            freed = self._apply(self.tree.evict_ranked(max(1, step_bytes), keep_checkpoints, group, spare_wanted))
            if not freed.actions:
                break
            total.extend(freed)
        return total
