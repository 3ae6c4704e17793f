"""Add the k3 cache's counters to the scheduler's internal state (``GET /server_info``).

``/server_info`` returns, per DP rank, what ``SchedulerInternalStateController.get_internal_state``
gathers in the scheduler process, under ``internal_states``; the rest of ``/server_info`` is fixed
at startup. No registry contributes to it, so an after-hook adds one entry, ``k3_cache``
(:func:`sglang_k3.integration.observability.server_snapshot`), when the scheduler's cache is k3.
The same snapshot refreshes the ``sglang_k3_*`` Prometheus series, so both read alike.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
REASON = "/server_info has no extension point for a radix-cache backend's live counters"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def add_k3_cache_state(result, self, *args, **kwargs):
    from sglang_k3.integration import observability as obs
    from sglang_k3.integration.scheduler_verbs import verbs_of

    scheduler = self.scheduler
    verbs = verbs_of(getattr(scheduler, "tree_cache", None))
    if verbs is None or result is None:
        return result
    snap = verbs.snapshot()
    result.internal_state[obs.SERVER_INFO_KEY] = snap
    obs.update_metrics(scheduler, snap)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, add_k3_cache_state, HookType.AFTER)
