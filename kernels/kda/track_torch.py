"""Torch reference of upstream's Mamba/KDA state tracking copy (``extra_buffer``).

Upstream's ``sglang.kernels.ops.mamba.mamba_state_scatter_triton._launch_track_mamba_states`` is a
Triton kernel: for each batch row whose ``mamba_track_mask`` is set, it copies the row's conv and
recurrent state, in every layer, from the request's working slot ``cache_indices[i]`` to its
track slot ``mamba_track_indices[i]``. That copy is how ``--mamba-radix-cache-strategy
extra_buffer`` snapshots a state at a track boundary while the working slot runs on. Here it is
the same copy as indexed torch ops, so extra_buffer can run on CPU (sglang-k3's live baseline at
upstream's real default).
"""

from __future__ import annotations

import torch


def track_states_torch(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    layered: bool,
    check_freed_slots: bool = False,
) -> None:
    """``layered``: the pools are ``[num_layers, pool, ...]`` (every layer at once), else
    ``[pool, ...]`` (one layer). Rows with a freed slot (-1) are skipped when
    ``check_freed_slots``, as upstream's kernel skips them."""
    if batch_size == 0:
        return
    mask = mamba_track_mask[:batch_size].to(torch.bool)
    src = cache_indices[:batch_size].to(torch.int64)[mask]
    dst = mamba_track_indices[:batch_size].to(torch.int64)[mask]
    if check_freed_slots:
        ok = (src >= 0) & (dst >= 0)
        src, dst = src[ok], dst[ok]
    if src.numel() == 0:
        return
    for pool in (conv_states, ssm_states):
        if layered:
            pool[:, dst] = pool[:, src]
        else:
            pool[dst] = pool[src]
