"""Route MLA layers to the absorbed (latent-cache) forward under ``torch_native`` attention.

``AttentionBackendRegistry`` maps an attention-backend name to the function that picks the MLA
forward method. ``torch_native`` has no entry, so upstream falls back to the Triton handler, which
picks the MHA path for prefills without a prefix and fails on CPU. The absorbed MLA method works
over the latent KV cache with ``torch_native``'s SDPA kernels for prefill, extend and decode alike.
"""

from __future__ import annotations

_BACKEND = "torch_native"


def _handle_torch_native(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    AttentionBackendRegistry.register(_BACKEND, _handle_torch_native)
