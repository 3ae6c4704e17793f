"""Refresh the waiting queue's prefixes at every scheduling call while the k3 cache evicts.

``SchedulePolicy._touch_waiting_prefixes`` (``managers/schedule_policy.py``) touches the prefixes
of the first 128 waiting requests, head last, so that LRU eviction spares what the next requests
will hit; it does so at one ``calc_priority`` call in 32 (``WAITING_PREFIX_REFRESH_INTERVAL``).
The k3 tree reads more from a refresh than recency: which checkpoints the queue will restore
from and in what order, and eviction takes those last, the queue's tail first
(:func:`sglang_k3.cache.ranking.rank`). ``calc_priority`` runs when a prefill batch may be
formed, that is when a running request finished and made room, so with a full running batch a
refresh every 32nd call is many finished turns late: their next turns sit in the queue unknown,
and the order eviction reads is stale. Around the method, when the cache is k3 and it evicted
since the last refresh (:meth:`~sglang_k3.integration.k3_cache.K3RadixCache.refresh_waiting_now`),
the call counter is set so that this call refreshes; every other condition of upstream's
(policy, environment switch, disaggregation mode, eviction policy) is upstream's own. When the
queue is empty the last refresh's wants end (``K3RadixTree.end_wants``). These extra refreshes
only touch: the lower tiers' prefetch lookups stay at upstream's interval. Without evictions, or
with another cache, nothing changes.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy._touch_waiting_prefixes"
REASON = "the k3 tree orders eviction by the waiting queue; a refresh every 32nd call is stale under pressure"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def refresh_while_evicting(original, self, policy, waiting_queue):
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(getattr(self, "tree_cache", None))
    if verbs is not None and not waiting_queue:
        verbs.waiting_queue_empty()  # nothing waits: no checkpoint is wanted
    elif verbs is not None and verbs.refresh_waiting_now():
        calls = self._waiting_prefix_refresh_calls
        self._waiting_prefix_refresh_calls = 0  # a count of 0 refreshes at this call
        try:
            with verbs.eviction_refresh():  # touch only: no lower-tier prefetch lookups (touch_prefix)
                return original(self, policy, waiting_queue)
        finally:
            self._waiting_prefix_refresh_calls = calls  # upstream's own interval goes on as it was
    return original(self, policy, waiting_queue)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, refresh_while_evicting, HookType.AROUND)
