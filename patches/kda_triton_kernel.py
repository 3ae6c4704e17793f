"""CPU implementations of ``TritonKDAKernel``'s methods (KDA extend / decode / packed decode, and the
speculative verify of a draft chain).

``KDAKernelDispatcher`` always builds a ``TritonKDAKernel`` and offers no registry for a custom
KDA kernel backend, so the methods are replaced in place (``supports_*`` flags stay upstream's:
on a non-``is_cpu()`` host ``supports_packed_decode`` is True and decode goes through
``packed_decode``; under ``SGLANG_USE_CPU_ENGINE=1`` it is False and goes through ``decode``).
"""

from __future__ import annotations

from sglang_k3.kernels.kda.pool_ops import (
    kda_chunk_extend_pool,
    kda_packed_decode_pool,
    kda_recurrent_decode_pool,
    kda_target_verify_pool,
)

TARGET = "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel"
REASON = "TritonKDAKernel runs fla Triton kernels; KDAKernelDispatcher has no custom-kernel registry"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True

_REPLAYSSM_KEYS = ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_write_pos")
_VERIFY_UNSUPPORTED = ("replayssm_rawv", "fused_accept_state_indices", "fused_accept_num_accepted")


def extend_cpu(
    self,
    q,
    k,
    v,
    g,
    beta,
    *,
    ssm_states,
    cache_indices,
    query_start_loc,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    beta_is_raw=False,
    return_intermediate_states=False,
    **kwargs,
):
    return kda_chunk_extend_pool(
        q,
        k,
        v,
        g,
        beta,
        ssm_states=ssm_states,
        cache_indices=cache_indices,
        query_start_loc=query_start_loc,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_is_raw=beta_is_raw,
        use_qk_l2norm_in_kernel=True,
        return_intermediate_states=return_intermediate_states,
        track_state=kwargs.get("track_state"),
        track_chunk_idx=kwargs.get("track_chunk_idx"),
    )


def decode_cpu(
    self,
    q,
    k,
    v,
    a,
    b,
    *,
    A_log,
    dt_bias,
    ssm_states,
    cache_indices,
    query_start_loc,
    lower_bound=None,
    **kwargs,
):
    return kda_recurrent_decode_pool(
        q,
        k,
        v,
        a,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        ssm_states=ssm_states,
        cache_indices=cache_indices,
        query_start_loc=query_start_loc,
        lower_bound=lower_bound,
    )


def packed_decode_cpu(
    self,
    mixed_qkv,
    a,
    b,
    *,
    A_log,
    dt_bias,
    scale,
    ssm_states,
    cache_indices,
    num_v_heads,
    head_v_dim,
    lower_bound=None,
    **kwargs,
):
    if any(kwargs.get(key) is not None for key in _REPLAYSSM_KEYS):
        raise NotImplementedError("KDA ReplaySSM decode is not available on the CPU path")
    return kda_packed_decode_pool(
        mixed_qkv,
        a,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        ssm_states=ssm_states,
        cache_indices=cache_indices,
        num_v_heads=num_v_heads,
        head_v_dim=head_v_dim,
        lower_bound=lower_bound,
    )


def target_verify_cpu(
    self,
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    *,
    ssm_states,
    cache_indices,
    query_start_loc,
    intermediate_states_buffer,
    intermediate_state_indices,
    cache_steps,
    retrieve_parent_token=None,
    lower_bound=None,
    **kwargs,
):
    """Speculative verify of a draft chain (NGRAM with one branch: ``retrieve_parent_token``
    None), writing the state after every draft token to the scratch the commit reads."""
    if retrieve_parent_token is not None:
        raise NotImplementedError(
            "KDA tree verify (draft trees with more than one branch) is not available on the CPU path; "
            "use --speculative-ngram-max-bfs-breadth 1"
        )
    if intermediate_states_buffer is None or any(kwargs.get(key) is not None for key in _VERIFY_UNSUPPORTED):
        raise NotImplementedError("KDA verify without per-step states (ReplaySSM, fused accept) on the CPU path")
    return kda_target_verify_pool(
        q,
        k,
        v,
        a,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        ssm_states=ssm_states,
        cache_indices=cache_indices,
        query_start_loc=query_start_loc,
        intermediate_states_buffer=intermediate_states_buffer,
        intermediate_state_indices=intermediate_state_indices,
        cache_steps=cache_steps,
        lower_bound=lower_bound,
    )


METHODS = {
    "extend": extend_cpu,
    "decode": decode_cpu,
    "packed_decode": packed_decode_cpu,
    "target_verify": target_verify_cpu,
}


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    for name, fn in METHODS.items():
        replace_unless_cuda(f"{TARGET}.{name}", fn)
