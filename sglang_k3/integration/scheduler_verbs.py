"""Every call SGLang's scheduler makes into the k3 cache beyond ``BasePrefixCache``, in one object.

SGLang 0.5.23 calls a radix cache through ``BasePrefixCache`` (match, insert via ``checkpoint``,
locks, evict, sizes). The k3 cache needs a few more moments of the scheduler's step, which no
registry offers; each is a hook in ``patches/`` and each calls exactly one verb here, found with
:func:`verbs_of` (None for SGLang's own cache or a disabled one, so every patch is a no-op then).
In the order one scheduler iteration reaches them:

==========================================  =====================================================
patch (upstream symbol)                      verb
==========================================  =====================================================
``scheduler_hold_tier_loads``                :meth:`~SchedulerVerbs.held_back` (the waiting
(``Scheduler._get_new_batch_prefill_raw``)   requests that sit out this admission),
                                             :meth:`~SchedulerVerbs.idle_while_held`
``schedule_policy_waiting_refresh``          :meth:`SchedulerVerbs.waiting_queue_empty`,
(``SchedulePolicy._touch_waiting_prefixes``) :meth:`~SchedulerVerbs.refresh_waiting_now`,
                                             :meth:`~SchedulerVerbs.eviction_refresh`
``match_kv_cache_k3``                        :meth:`~SchedulerVerbs.lookups` (around the admitting
(``mem_cache.common.match_kv_cache``)        match; observability records the lookup on the Req)
``prefill_adder_not_admitted``               :meth:`~SchedulerVerbs.states_ready`,
(``PrefillAdder.add_one_req``)               :meth:`~SchedulerVerbs.not_admitted`
``scheduler_process_batch_result_k3``        :meth:`~SchedulerVerbs.begin_step` ...
(``Scheduler.process_batch_result``)         :meth:`~SchedulerVerbs.end_step`
``batch_result_decode_checkpoint``           :meth:`~SchedulerVerbs.after_decode` (inside the step)
(the decode result processor)
``spec_finish_rewind`` (the decode result    :meth:`~SchedulerVerbs.speculative_stop` (a request
processor's ``_mamba_can_cache_finished_req``) that stopped inside a verify's tokens)
``scheduler_internal_state_k3``,             :meth:`~SchedulerVerbs.snapshot` (``/server_info``,
``scheduler_output_streamer_k3``             ``/metrics``; the per-request ``meta_info`` fields)
==========================================  =====================================================

``docs/sglang_cache_contract.md`` says why each moment matters. Nothing here decides anything: each
verb hands the moment to the cache, whose lifecycle and retention decide.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional, Sequence


class SchedulerVerbs:
    def __init__(self, cache) -> None:
        self.cache = cache  # the K3RadixCache this scheduler built

    # ---------------------------------------------------------------- the waiting queue
    def waiting_queue_empty(self) -> None:
        """Nothing waits: no checkpoint is wanted by a queued request any more."""
        self.cache.tree.end_wants()

    def refresh_waiting_now(self) -> bool:
        """Whether the waiting queue's refresh should run at this scheduling call rather than at
        SGLang's own interval (yes when the tree evicted since the last such answer)."""
        return self.cache.refresh_waiting_now()

    @contextlib.contextmanager
    def eviction_refresh(self) -> Iterator[None]:
        """A refresh k3 asked for: it orders eviction only (no lower-tier prefetch lookups)."""
        self.cache.eviction_refresh = True
        try:
            yield
        finally:
            self.cache.eviction_refresh = False

    # ---------------------------------------------------------------- admission
    def may_hold(self) -> bool:
        """Whether :meth:`held_back` can leave anything out (lower tiers, a host tier above
        another): checked before the call counts its free rows."""
        return self.cache.may_hold()

    def held_back(self, queue: Sequence, room: int) -> list:
        """The waiting requests to leave out of this scheduling call's admission, which can admit
        ``room`` more: those whose boundary is being copied up from a lower tier
        (:meth:`K3RadixCache.held_back`)."""
        return self.cache.held_back(queue, room)

    def idle_while_held(self) -> None:
        """The call admitted nothing, nothing runs, and requests are held back: wait a moment for
        their copies up instead of spinning (:meth:`CacheLifecycle.wait_for_tiers
        <sglang_k3.cache.lifecycle.CacheLifecycle.wait_for_tiers>`)."""
        self.cache.lifecycle.wait_for_tiers()

    def lookups(self) -> int:
        """The tree's lookup count (read around an admitting match to find its record)."""
        return self.cache.tree.stats.lookups

    def states_ready(self, need: int) -> bool:
        """Whether the batch being filled can have ``need`` state slots at its allocation (evicting
        for them now if needed): :meth:`K3RadixCache.state_slots_ready`."""
        return self.cache.state_slots_ready(need)

    def not_admitted(self, req) -> None:
        """The prefill adder matched ``req`` and then did not admit it: drop what the match holds."""
        self.cache.match_not_admitted(req)

    # ---------------------------------------------------------------- one step's results
    def begin_step(self) -> None:
        """A batch's results are about to be processed: queue its checkpoint stores."""
        self.cache.begin_store_scope()

    def end_step(self) -> None:
        """The batch's results are processed: run the queued stores in one launch."""
        self.cache.end_store_scope()

    def after_decode(self, reqs: Iterable, advanced: Optional[Sequence[int]] = None) -> None:
        """After a decode step: every ``--k3-decode-checkpoint-interval`` tokens, checkpoint each
        running request that was not retracted. ``advanced``: the tokens each request committed
        in the step (a speculative verify's accept lengths; one each without speculation)."""
        for i, req in enumerate(reqs):
            if not getattr(req, "is_retracted", False):
                self.cache.checkpoint_decode(req, 1 if advanced is None else int(advanced[i]))

    def speculative_stop(self, req, row: int, accepted: int) -> bool:
        """A request stopped inside the tokens a speculative verify committed: set its state back
        to the stop so its turn is cached (:meth:`K3RadixCache.rewind_to_stop`)."""
        return self.cache.rewind_to_stop(req, row, accepted)

    # ---------------------------------------------------------------- observability
    def snapshot(self) -> dict[str, Any]:
        """The cache's counters and levels (the ``/server_info`` entry and the metrics)."""
        return self.cache.server_snapshot()


def verbs_of(tree_cache: Any) -> Optional[SchedulerVerbs]:
    """The verbs of ``tree_cache`` if it is the k3 cache (which builds its own), else None
    (SGLang's own cache, a disabled cache, or none)."""
    verbs = getattr(tree_cache, "scheduler_verbs", None)
    return verbs if isinstance(verbs, SchedulerVerbs) else None
