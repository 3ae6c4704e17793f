"""Select an output streamer that adds the k3 per-request fields to ``meta_info``.

Upstream's extension contract for extra response metadata (``sglang.srt.sampling.
sampling_observer``): the scheduler selects a ``SchedulerOutputStreamer`` subclass through
``Scheduler.get_output_streamer_class``; the subclass returns per-request values from
``build_additional_customized_info``; the tokenizer manager merges them into ``meta_info``. With
the k3 cache this after-hook returns that subclass
(:class:`sglang_k3.integration.observability.K3OutputStreamerMixin` over whatever class was
selected). Upstream refuses extra fields with the Rust egress, so it is left alone there.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
REASON = "per-request k3 fields (restore boundary, replayed tokens) go out through a streamer subclass"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def k3_output_streamer_class(result, self, *args, **kwargs):
    from sglang_k3.integration import observability as obs
    from sglang_k3.integration.scheduler_verbs import verbs_of

    if (
        result is None
        or not getattr(self, "is_generation", False)
        or getattr(self, "rust_server", None) is not None
        or verbs_of(getattr(self, "tree_cache", None)) is None
    ):
        return result
    return obs.streamer_class(result)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, k3_output_streamer_class, HookType.AFTER)
