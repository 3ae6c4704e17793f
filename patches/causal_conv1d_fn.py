"""CPU replacement for upstream's Triton varlen causal conv1d (KDA/Mamba prefill)."""

from __future__ import annotations

from sglang_k3.kernels.kda.conv1d_torch import PAD_SLOT_ID, causal_conv1d_varlen_torch

TARGET = "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn"
REASON = "causal_conv1d_fn is Triton-only; the KDA extend path calls it on CPU too"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def causal_conv1d_fn_cpu(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    seq_lens_cpu=None,
    cache_indices=None,
    has_initial_state=None,
    activation="silu",
    pad_slot_id=PAD_SLOT_ID,
    validate_data=False,
    block_table=None,
    **kwargs,
):
    """Upstream's signature; ``x`` ``[dim, T]``, ``conv_states`` ``[slots, dim, width-1]`` (in place)."""
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn(block_table=...) (CUDA-graph launch) on CPU")
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    return causal_conv1d_varlen_torch(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices=cache_indices,
        has_initial_state=has_initial_state,
        activation=activation,
        pad_slot_id=pad_slot_id,
    )


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, causal_conv1d_fn_cpu)
