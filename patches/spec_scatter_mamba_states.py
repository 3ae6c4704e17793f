"""Speculative decoding on CPU: ``scatter_mamba_states_after_mtp_verify`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.scatter_mamba_states_after_mtp_verify`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify"
REASON = "committing the accepted step's KDA state after a verify raises unless the tensors are CUDA/XPU"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.scatter_mamba_states_after_mtp_verify)
