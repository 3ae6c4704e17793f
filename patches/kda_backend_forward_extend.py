"""Record each KDA extend's sequences and pre-conv input for checkpoint export.

The k3 cache keeps states at chunk boundaries that the extend forward computes anyway. Upstream
only exports them for its own ``extra_buffer`` tracking; under ``no_buffer`` they are dropped.
This AROUND hook tells the export stash which sequences (by active slot, prefix and extend length,
and request id: ``ForwardBatch.rids``, set for every batch built by ``ForwardBatch.init_new``)
this forward covers and which KDA layer is running, so the kernel hook can keep the rows of its
``h`` that the cache may store. Without request ids the stash keeps each sequence's last grid
point only. The stash is the k3 cache's own, reached through the pool SGLang gives both the cache
and this backend (``sglang_k3/state/forward_state.py``); with no k3 cache on that pool, the hook
does nothing.

The same hook runs the quantized checkpoint restores the cache deferred to this forward, all in
one launch, before the first KDA layer reads the pool (``sglang_k3/state/deferred_restore.py``).
"""

from __future__ import annotations

import torch

from sglang_k3.state.export_context import CURRENT_EXTEND, CurrentExtend
from sglang_k3.state.forward_state import attached

TARGET = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend.forward_extend"
REASON = "no_buffer drops the chunk-boundary states the k3 cache checkpoints without a second forward"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def _exportable(backend, stash, forward_batch, mixed_qkv) -> bool:
    return (
        stash.enabled
        and isinstance(mixed_qkv, torch.Tensor)
        and not forward_batch.forward_mode.is_target_verify()
        and getattr(backend, "prefill_graph_metadata", None) is None
        and forward_batch.extend_prefix_lens_cpu is not None
        and forward_batch.extend_seq_lens_cpu is not None
    )


def forward_extend_recording(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    fwd = attached(self.req_to_token_pool)
    if fwd is None:
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    if len(fwd.restores):
        # quantized checkpoint hits of this forward, dequantized into their requests' slots in one
        # launch before the first KDA layer reads the pool (sglang_k3/state/deferred_restore.py)
        fwd.restores.flush()
    stash = fwd.stash
    if not _exportable(self, stash, forward_batch, mixed_qkv):
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    if stash.starts_forward(id(forward_batch), layer.layer_id):
        # once per forward: the slot list is a device tensor, and .tolist() waits for the device
        stash.begin(
            id(forward_batch),
            self.forward_metadata.mamba_cache_indices.tolist(),
            list(forward_batch.extend_prefix_lens_cpu),
            list(forward_batch.extend_seq_lens_cpu),
            rids=None if getattr(forward_batch, "rids", None) is None else list(forward_batch.rids),
        )
    token = CURRENT_EXTEND.set(CurrentExtend(layer.layer_id, mixed_qkv, stash))
    try:
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    finally:
        CURRENT_EXTEND.reset(token)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, forward_extend_recording, HookType.AROUND)
