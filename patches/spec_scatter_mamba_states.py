"""Speculative decoding on CPU: ``scatter_mamba_states_after_mtp_verify`` through SGLang's own
torch fallback.

After a verify SGLang copies, per request, the recurrent state and the conv windows of its last
accepted step from the verify's per-step scratch into its slot (and, with ``extra_buffer``
tracking, the crossed interval's step into its track slot). ``scatter_mamba_states_after_mtp_verify``
does it with fused kernels that raise unless the tensors are CUDA or XPU; SGLang has the same copy
in torch for other states (``HybridLinearAttnBackend._scatter_speculative_state_with_mask``:
``dst[:, dst_idx] = src[:, src_idx, step]``, a step or slot of -1 skipped), which this applies to
the recurrent state and every conv state.
"""

from __future__ import annotations

TARGET = "sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify"
REASON = "committing the accepted step's KDA state after a verify raises unless the tensors are CUDA/XPU"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def scatter_after_verify_cpu(
    mamba_caches,
    state_indices_tensor,
    last_correct_step_indices,
    mamba_track_indices,
    mamba_steps_to_track,
    src_indices_raw=None,
) -> None:
    """Upstream's contract: the recurrent state and every conv state of each slot in
    ``state_indices_tensor`` take verify row ``i``'s (or ``src_indices_raw[i]``'s) step
    ``last_correct_step_indices[i]``; the track slots likewise their ``mamba_steps_to_track``."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += zip(mamba_caches.conv, mamba_caches.intermediate_conv_window)
    for dst, src in pairs:
        if dst is None or dst.numel() == 0:
            continue
        scatter(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None:
            scatter(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, scatter_after_verify_cpu)
