"""CPU implementations of ``TritonKDAKernel``'s methods (KDA extend / decode / packed decode).

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
)

TARGET = "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel"
REASON = "TritonKDAKernel runs fla Triton kernels; KDAKernelDispatcher has no custom-kernel registry"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True

_REPLAYSSM_KEYS = ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_write_pos")


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


def target_verify_cpu(self, *args, **kwargs):
    raise NotImplementedError(
        "KDA speculative target_verify is not available on the CPU path (serve without speculative decoding)"
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
