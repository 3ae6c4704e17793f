"""KDA kernels called the way SGLang's KDA backend calls its Triton kernels.

The contracts here are upstream's (sglang 0.5.23, ``TritonKDAKernel`` and the fla kernels it
wraps), so the CPU path is a drop-in:

- recurrent-state pool ``ssm_states``: ``[num_slots, H, V, K]`` (V-first; a per-slot strided view
  is fine), read at ``cache_indices[n]`` as sequence ``n``'s initial state and overwritten in
  place with its final state. A slot of ``-1`` (padding) starts from zeros and is not written.
  ``has_initial_state`` is NOT consulted for the recurrent state (upstream's kernels don't): a
  fresh request's slot must be zeroed by the pool, as upstream's pool does.
- ``query_start_loc``: ``[N + 1]`` cumulative token counts over the packed batch.
- gates: raw ``g`` plus ``A_log``/``dt_bias`` (``lower_bound`` selects the safe gate); ``beta``
  raw (sigmoid applied here) when ``beta_is_raw`` (extend) and always in decode.
- q/k are L2-normalised inside (``use_qk_l2norm_in_kernel=True`` upstream); scale ``K ** -0.5``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .chunk_torch import chunk_kda_torch, chunk_layout
from .gate_torch import kda_gate
from .recurrent_torch import fused_recurrent_kda_torch


def _load_states(ssm_states: torch.Tensor, idx: torch.Tensor, H: int, K: int, V: int):
    """Initial states ``[N, H, V, K]`` fp32 from the pool (zeros for padded slots)."""
    N = idx.numel()
    init = torch.zeros(N, H, V, K, dtype=torch.float32)
    valid = (idx >= 0).nonzero(as_tuple=True)[0]
    if valid.numel() > 0:
        init[valid] = ssm_states[idx[valid]].float()
    return init, valid


def kda_chunk_extend_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    beta_is_raw: bool = False,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = True,
    return_intermediate_states: bool = False,
    track_state: Optional[torch.Tensor] = None,
    track_chunk_idx: Optional[torch.Tensor] = None,
):
    """Chunked KDA extend over a packed varlen batch (``TritonKDAKernel.extend`` contract).

    q, k ``[1, T, H, K]``; v ``[1, T, H, V]``; g ``[1, T, H, K]`` (raw if ``A_log`` is given, else
    the activated log decay); beta ``[1, T, H]``. Updates ``ssm_states`` in place. Returns
    ``o`` ``[1, T, H, V]`` (``v.dtype``), or ``(o, h)`` when ``return_intermediate_states``, with
    ``h`` ``[1, NT, H, V, K]`` fp32: for sequence ``n`` (chunks packed in order),
    ``h[0, chunk_offsets[n] + i]`` is its state after ``64 * i`` of this call's tokens (``i = 0``:
    the initial state). ``track_state[n]`` (fp32 ``[N, H, V, K]``), when given, receives
    ``h[0, chunk_offsets[n] + track_chunk_idx[n]]`` for indices inside the sequence's chunks.
    """
    assert (track_state is None) == (track_chunk_idx is None)
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if beta_is_raw:
        beta = torch.sigmoid(beta.float())
    idx = cache_indices.to(torch.long).cpu()
    init, valid = _load_states(ssm_states, idx, HV, K, V)
    need_h = return_intermediate_states or track_state is not None
    res = chunk_kda_torch(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=query_start_loc,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        return_intermediate_states=need_h,
        state_v_first=True,
    )
    o, final = res[0], res[1]
    if valid.numel() > 0:
        ssm_states[idx[valid]] = final[valid].to(ssm_states.dtype)
    h = res[2] if need_h else None
    if track_state is not None:
        _, _, offsets, _ = chunk_layout(query_start_loc.to(torch.long).cpu())
        tci = track_chunk_idx.to(torch.long).cpu()
        for n in range(tci.numel()):
            nc = int(offsets[n + 1] - offsets[n])
            i = int(tci[n])
            if 0 <= i < nc:
                track_state[n] = h[0, int(offsets[n]) + i].to(track_state.dtype)
    if return_intermediate_states:
        return o, h
    return o


def kda_recurrent_decode_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """Recurrent KDA decode (``fused_sigmoid_gating_delta_rule_update(is_kda=True)`` contract).

    q, k ``[1, T, H, K]``; v ``[1, T, HV, V]``; ``a`` raw gate with ``T * HV * K`` elements
    (``[T, HV*K]``, ``[1, T, HV*K]`` or ``[1, T, HV, K]``); ``b`` raw beta with ``T * HV``
    elements. Sequences are given by ``query_start_loc`` (one token each in plain decode); without
    it, each batch row of q is one sequence. Updates ``ssm_states`` in place; returns
    ``o`` ``[1, T, HV, V]`` (``q.dtype``).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    g = kda_gate(a.reshape(B, T, HV, K), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.reshape(B, T, HV).float())
    idx = cache_indices.to(torch.long).cpu()
    init, valid = _load_states(ssm_states, idx, HV, K, V)
    o, final = fused_recurrent_kda_torch(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=query_start_loc,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state_v_first=True,
    )
    if valid.numel() > 0:
        ssm_states[idx[valid]] = final[valid].to(ssm_states.dtype)
    return o.to(q.dtype)


def kda_packed_decode_pool(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    num_v_heads: int,
    head_v_dim: int,
    lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """Packed decode (``TritonKDAKernel.packed_decode`` contract): one token per sequence;
    ``mixed_qkv`` ``[B, H*K + H*K + HV*V]`` is the conv output. Returns ``[1, B, HV, V]``."""
    Bsz = mixed_qkv.shape[0]
    K = ssm_states.shape[-1]
    qk_dim = (mixed_qkv.shape[1] - num_v_heads * head_v_dim) // 2
    H = qk_dim // K
    q, k, v = mixed_qkv.split([qk_dim, qk_dim, num_v_heads * head_v_dim], dim=-1)
    q = q.reshape(1, Bsz, H, K)
    k = k.reshape(1, Bsz, H, K)
    v = v.reshape(1, Bsz, num_v_heads, head_v_dim)
    qsl = torch.arange(Bsz + 1, dtype=torch.long)
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
        query_start_loc=qsl,
        lower_bound=lower_bound,
        scale=scale,
    ).to(mixed_qkv.dtype)


def kda_target_verify_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    intermediate_states_buffer: torch.Tensor,
    intermediate_state_indices: torch.Tensor,
    cache_steps: int,
    lower_bound: Optional[float] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Speculative verify of a chain of draft tokens (``TritonKDAKernel.target_verify`` contract,
    ``retrieve_parent_token`` None: each token follows the one before it).

    Sequence ``n`` (tokens ``query_start_loc[n]`` to ``query_start_loc[n+1]``, at most
    ``cache_steps``) starts from ``ssm_states[cache_indices[n]]``; the state after its ``t``-th
    token is written to ``intermediate_states_buffer[intermediate_state_indices[n], t]`` (same
    V-first layout as the pool). ``ssm_states`` is NOT written: after the verify SGLang copies the
    state after the last accepted token from the scratch into the slot. A slot of ``-1`` starts
    from zeros and writes nothing. Returns ``o`` ``[1, T, HV, V]`` (``q.dtype``)."""
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    cu = query_start_loc.to(torch.long).cpu()
    N = cu.numel() - 1
    g = kda_gate(a.reshape(1, T, HV, K), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.reshape(1, T, HV).float())
    idx = cache_indices[:N].to(torch.long).cpu()
    S, _ = _load_states(ssm_states, idx, HV, K, V)  # [N, HV, V, K]
    rows_out = intermediate_state_indices[:N].to(torch.long).cpu()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    if N and int(lens.max()) > cache_steps:
        raise ValueError(f"a verify sequence of {int(lens.max())} tokens exceeds cache_steps={cache_steps}")
    o = torch.zeros(1, T, HV, V, dtype=q.dtype)
    for t in range(int(lens.max()) if N else 0):
        act = (lens > t).nonzero(as_tuple=True)[0]
        rows = starts[act] + t
        one = torch.arange(act.numel() + 1, dtype=torch.long)
        o_t, S_t = fused_recurrent_kda_torch(
            q[:, rows],
            k[:, rows],
            v[:, rows],
            g[:, rows],
            beta[:, rows],
            scale=scale,
            initial_state=S[act],
            output_final_state=True,
            cu_seqlens=one,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )
        o[:, rows] = o_t.to(q.dtype)
        S[act] = S_t
        keep = act[(idx[act] >= 0)]
        if keep.numel():
            intermediate_states_buffer[rows_out[keep], t] = S[keep].to(intermediate_states_buffer.dtype)
    return o
