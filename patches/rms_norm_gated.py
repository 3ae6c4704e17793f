"""CPU replacement for upstream's Triton gated RMSNorm (the KDA output norm, ``o_norm``)."""

from __future__ import annotations

from sglang_k3.kernels.kda.gated_rmsnorm_torch import rms_norm_gated_torch

# FusedRMSNormGated.forward calls this module-level function (its sgl_kernel CPU branch is only
# taken under SGLANG_USE_CPU_ENGINE=1 with AMX, and only for activation "silu"; Kimi uses "sigmoid").
TARGET = "sglang.kernels.ops.attention.fla.fused_norm_gate.rms_norm_gated"
REASON = "rms_norm_gated is Triton-only; kimi_linear's o_norm (FusedRMSNormGated) calls it"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def rms_norm_gated_cpu(
    x,
    g,
    weight,
    bias,
    activation="swish",
    residual=None,
    prenorm=False,
    residual_in_fp32=False,
    eps=1e-6,
):
    return rms_norm_gated_torch(
        x,
        g,
        weight,
        bias,
        activation=activation,
        residual=residual,
        prenorm=prenorm,
        residual_in_fp32=residual_in_fp32,
        eps=eps,
    )


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, rms_norm_gated_cpu)
