"""Speculative decoding on CPU: an EAGLE draft's attention runs on SGLang's torch-native backend.

SGLang 0.5.23 builds a draft model's attention backends in ``DraftBackendFactory``
(``speculative/draft_utils.py``) from tables of GPU backends (triton, flashinfer, fa3, ...); the
CPU platform's backend, ``torch_native``, is in neither, so an EAGLE draft worker stops at
``EAGLE is not supported in attention backend torch_native``. Around ``_create_backend``, on a
host without CUDA, both tables get a ``torch_native`` entry:

* the draft-extend table: SGLang's own ``TorchNativeAttnBackend`` over the draft runner's pools
  (the draft is an ordinary Llama attention layer, which that backend serves for extend and
  decode);
* the multi-step draft-decode table (``--speculative-num-steps`` above 1):
  :class:`TorchNativeMultiStepDraftBackend`, one torch-native backend per draft step, as the GPU
  tables hold one Triton or FlashInfer backend per step.

Draft step ``i`` (0-based) decodes the ``i``-th draft token of a chain, whose KV SGLang placed at
``req_to_token[req, seq_len + i]`` (``assign_draft_cache_locs_contiguous``): it attends to the
committed prefix and the draft tokens up to and including its own, ``seq_len + i + 1`` entries
of the request's row, where SGLang's batch says ``seq_len`` (the committed prefix). The
torch-native backend reads the lengths from the batch, so each step's backend hands it its own.
Chains only (``--speculative-eagle-topk 1``, which the k3 cache requires: ``check_speculative``):
a tree's branches would need their own rows."""

from __future__ import annotations

TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
REASON = "the draft backend tables have no torch_native entry (CPU's attention backend)"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def _step_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeDraftStepBackend(TorchNativeAttnBackend):
        """Draft step ``step``'s attention: the torch-native decode over ``seq_lens + step + 1``
        entries of each request's row (the prefix and the chain's drafts up to this one)."""

        def __init__(self, model_runner, step: int) -> None:
            super().__init__(model_runner)
            self.step = step
            self.step_seq_lens = None

        def init_forward_metadata(self, forward_batch) -> None:
            super().init_forward_metadata(forward_batch)
            self.step_seq_lens = forward_batch.seq_lens + (self.step + 1)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            committed = forward_batch.seq_lens
            forward_batch.seq_lens = self.step_seq_lens
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = committed

    return TorchNativeDraftStepBackend


class TorchNativeMultiStepDraftBackend:
    """The per-step container SGLang's EAGLE worker asks for when it drafts more than one token a
    verify: ``attn_backends[i]`` runs draft step ``i``; :meth:`init_forward_metadata` readies them
    all for one draft (the last step only samples, so ``steps - 1`` backends)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
        if topk != 1:
            raise ValueError(
                f"--speculative-eagle-topk {topk}: on CPU the torch-native draft decode drafts chains only (topk 1)"
            )
        cls = _step_backend_class()
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.attn_backends = [cls(model_runner, i) for i in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def with_torch_native(original_fn, self, backend_name, backend_map, error_template, stamps_children=False):
    if "torch_native" not in backend_map:
        runner = self.draft_model_runner
        if stamps_children:  # the multi-step draft-decode table
            steps, topk = self.speculative_num_steps, self.topk
            entry = lambda: ("torch_native", TorchNativeMultiStepDraftBackend(runner, topk, steps))  # noqa: E731
        else:
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            entry = lambda: ("torch_native", TorchNativeAttnBackend(runner))  # noqa: E731
        backend_map = {**backend_map, "torch_native": entry}
    return original_fn(self, backend_name, backend_map, error_template, stamps_children)


def register() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, with_torch_native, HookType.AROUND)
