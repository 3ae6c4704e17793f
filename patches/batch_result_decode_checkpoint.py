"""Give the k3 cache a look at each request after every decode step.

Placement "every N decode tokens" needs a point where a request's state has just advanced by one
decode token; SGLang calls the tree cache during decode only to evict. This AFTER hook on the
decode result processor asks the cache (``checkpoint_decode``, k3 only) to fork the state of
requests whose committed length reached or (a speculative verify's several tokens) crossed a
multiple of the interval.
"""

from __future__ import annotations

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor.process_batch_result_decode"
)
REASON = "SGLang has no per-decode-step hook for the tree cache; k3 checkpoints every N decode tokens"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def checkpoint_after_decode(result, self, batch, *args, **kwargs):
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(getattr(self, "tree_cache", None))
    if verbs is not None:
        result = args[0] if args else kwargs.get("result")
        accept = getattr(result, "accept_lens", None)  # a speculative verify's committed tokens per request
        verbs.after_decode(batch.reqs, None if accept is None else accept.tolist())
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, checkpoint_after_decode, HookType.AFTER)
