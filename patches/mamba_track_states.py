"""CPU replacement for upstream's Triton state-tracking copy, so ``extra_buffer`` runs on CPU."""

from __future__ import annotations

from sglang_k3.kernels.kda.track_torch import track_states_torch

TARGET = "sglang.kernels.ops.mamba.mamba_state_scatter_triton._launch_track_mamba_states"
REASON = (
    "extra_buffer snapshots states with a Triton-only copy (decode: track_mamba_states_all_layers); "
    "on CPU it is the torch copy in kernels/kda/track_torch.py"
)
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def launch_track_cpu(
    conv_states,
    ssm_states,
    cache_indices,
    mamba_track_mask,
    mamba_track_indices,
    batch_size,
    num_layers,
    conv_strides,
    ssm_strides,
    conv_state_numel_per_row,
    ssm_state_numel_per_row,
    check_freed_slots,
):
    """Upstream's signature. Its two callers say the layout through the strides: all layers at once
    pass ``(layer stride, row stride)``, one layer passes ``(0, row stride)``."""
    track_states_torch(
        conv_states,
        ssm_states,
        cache_indices,
        mamba_track_mask,
        mamba_track_indices,
        batch_size,
        layered=conv_strides[0] != 0,
        check_freed_slots=check_freed_slots,
    )


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, launch_track_cpu)
