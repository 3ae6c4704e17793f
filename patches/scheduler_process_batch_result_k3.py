"""Around each processed batch: one store launch for the step, then the ``sglang_k3_*`` series.

1. **One store launch per step.** Every checkpoint of running and finishing requests is taken while
   ``process_batch_result`` handles a step's results (``cache_unfinished_req`` /
   ``cache_finished_req``). With int8/bf16 checkpoints each of those is a quantizing store. The k3
   cache queues them while this hook holds its store scope open, and runs them all in one launch
   when the step's results are done (``K3RadixCache.begin_store_scope`` / ``end_store_scope``). That
   is one launch and one refusal-flag sync per step instead of one per request.
2. **Metrics.** Upstream's scheduler pushes its own gauges from its metrics reporter at log
   intervals only (every ``decode_log_interval`` decode steps, or 30 s when idle), so a series fed
   from there lags behind the cache. Every k3 cache event (match, checkpoint, eviction, release)
   happens while a batch is scheduled or its result is processed, so refreshing after
   ``process_batch_result``, and after its stores, makes ``/metrics`` exact once the iteration that
   served a request is over. The refresh compares a few dozen ints and writes only what changed;
   it is a no-op without ``--enable-metrics`` or k3.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
REASON = (
    "the k3 cache batches a step's checkpoint stores into one launch, and its Prometheus "
    "series must follow the cache, not upstream's log interval"
)
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def process_batch_result_k3(original, self, *args, **kwargs):
    from sglang_k3.integration.observability import update_metrics
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(getattr(self, "tree_cache", None))
    if verbs is not None:
        verbs.begin_step()
    try:
        return original(self, *args, **kwargs)
    finally:
        if verbs is not None:
            verbs.end_step()
        update_metrics(self)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, process_batch_result_k3, HookType.AROUND)
