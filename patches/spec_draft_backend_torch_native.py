"""Speculative decoding on CPU: an EAGLE draft's attention runs on SGLang's torch-native backend.

SGLang 0.5.23 builds a draft model's attention backends in ``DraftBackendFactory``
(``speculative/draft_utils.py``) from tables of GPU backends (triton, flashinfer, fa3, ...); the
CPU platform's backend, ``torch_native``, is in neither, so an EAGLE draft worker stops at
``EAGLE is not supported in attention backend torch_native``. Around ``_create_backend``, on a
host without CUDA, the draft-extend table gets ``torch_native``: SGLang's own
``TorchNativeAttnBackend`` over the draft runner's pools (the draft is an ordinary Llama attention
layer, which that backend serves for extend and decode). The multi-step draft-decode table (more
than one draft step) is left as it is: a step-per-backend container has no torch-native version,
so ``--speculative-num-steps`` above 1 still stops there with upstream's message (``launch_server``
refuses it first on CPU, with the reason)."""

from __future__ import annotations

TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
REASON = "the draft-extend backend tables have no torch_native entry (CPU's attention backend)"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def with_torch_native(original_fn, self, backend_name, backend_map, error_template, stamps_children=False):
    if not stamps_children and "torch_native" not in backend_map:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        runner = self.draft_model_runner
        backend_map = {**backend_map, "torch_native": lambda: ("torch_native", TorchNativeAttnBackend(runner))}
    return original_fn(self, backend_name, backend_map, error_template, stamps_children)


def register() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, with_torch_native, HookType.AROUND)
