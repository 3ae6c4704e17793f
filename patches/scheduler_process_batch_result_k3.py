"""Refresh the ``sglang_k3_*`` Prometheus series after each processed batch.

Upstream's scheduler pushes its own gauges from its metrics reporter at log intervals only
(every ``decode_log_interval`` decode steps, or 30 s when idle), so a series fed from there lags
behind the cache. Every k3 cache event (match, checkpoint, eviction, release) happens while a
batch is scheduled or its result is processed, so refreshing after ``process_batch_result``
makes ``/metrics`` exact once the iteration that served a request is over. The refresh compares
a dozen ints and writes only what changed; it is a no-op without ``--enable-metrics`` or k3.
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
REASON = "the k3 cache's Prometheus series must follow the cache, not upstream's log interval"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def refresh_k3_metrics(result, self, *args, **kwargs):
    from sglang_k3.integration.observability import update_metrics

    update_metrics(self)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, refresh_k3_metrics, HookType.AFTER)
