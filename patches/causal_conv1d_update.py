"""CPU replacement for upstream's Triton causal conv1d update (KDA/Mamba decode)."""

from __future__ import annotations

from sglang_k3.kernels.kda.conv1d_torch import PAD_SLOT_ID, causal_conv1d_update_torch

TARGET = "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update"
REASON = "causal_conv1d_update is Triton-only off is_cpu() (env-gated); KDA decode and verify call it"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def causal_conv1d_update_cpu(
    x,
    conv_state,
    weight,
    bias=None,
    activation=None,
    cache_seqlens=None,
    conv_state_indices=None,
    num_accept_tokens=None,
    intermediate_conv_window=None,
    intermediate_state_indices=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    retrieve_parent_token=None,
    pad_slot_id=PAD_SLOT_ID,
    metadata=None,
    validate_data=False,
):
    """Upstream's signature: decode, and the speculative verify of a draft chain (the window after
    every draft token into ``intermediate_conv_window``); no circular buffer, no draft trees."""
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update(cache_seqlens=...) on CPU")
    if any(
        t is not None for t in (num_accept_tokens, retrieve_next_token, retrieve_next_sibling, retrieve_parent_token)
    ):
        raise NotImplementedError(
            "causal_conv1d_update over a draft tree on CPU; use --speculative-ngram-max-bfs-breadth 1"
        )
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    return causal_conv1d_update_torch(
        x,
        conv_state,
        weight,
        bias,
        activation=activation,
        conv_state_indices=conv_state_indices,
        pad_slot_id=pad_slot_id,
        intermediate_conv_window=intermediate_conv_window,
        intermediate_state_indices=intermediate_state_indices,
    )


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, causal_conv1d_update_cpu)
