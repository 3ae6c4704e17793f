"""Token-by-token KDA recurrence in pure torch (the CPU decode path).

One step, per value head (state ``S`` is ``[K, V]``, ``q`` already scaled):

    S = diag(exp(g)) S
    S = S + k (beta * (v - k^T S))^T
    o = q^T S

Vectorized over sequences and heads; varlen batches step all sequences together, so a decode
batch (one token per sequence) is one vectorized step.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gate_torch import l2norm


def kda_recurrent_step(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
):
    """One KDA step for a batch of states, in place on nothing.

    ``S`` ``[N, HV, K, V]`` fp32; ``q, k, g`` ``[N, HV, K]`` (q scaled); ``v`` ``[N, HV, V]``;
    ``beta`` ``[N, HV]``. Returns ``(o [N, HV, V], S_new)``.
    """
    S = S * torch.exp(g).unsqueeze(-1)
    err = v - (k.unsqueeze(-1) * S).sum(-2)
    S = S + k.unsqueeze(-1) * (beta.unsqueeze(-1) * err).unsqueeze(-2)
    o = (q.unsqueeze(-1) * S).sum(-2)
    return o, S


def fused_recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
):
    """Recurrent KDA forward (fla ``fused_recurrent_kda`` contract, activated gates).

    Shapes as ``chunk_kda_torch``: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``
    (log decay); beta ``[B, T, HV]`` (post-sigmoid); initial_state ``[N, HV, K, V]`` (or V-first).
    Returns ``(o [B, T, HV, V] in v.dtype, final_state fp32 or None)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    G = HV // H
    if scale is None:
        scale = K**-0.5
    if cu_seqlens is not None:
        assert B == 1, "cu_seqlens requires batch size 1"
        cu = cu_seqlens.to(torch.long).cpu()
    else:
        cu = torch.arange(0, B * T + 1, T, dtype=torch.long) if T > 0 else torch.zeros(B + 1, dtype=torch.long)
    N = cu.numel() - 1
    Ttot = B * T

    qf = q.reshape(Ttot, H, K).float()
    kf = k.reshape(Ttot, H, K).float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    if G > 1:
        qf = qf.repeat_interleave(G, dim=1)
        kf = kf.repeat_interleave(G, dim=1)
    qf = qf * scale
    vf = v.reshape(Ttot, HV, V).float()
    gf = g.reshape(Ttot, HV, K).float()
    bf = beta.reshape(Ttot, HV).float()

    S = torch.zeros(N, HV, K, V, dtype=torch.float32)
    if initial_state is not None:
        init = initial_state.float()
        S = (init.transpose(-1, -2) if state_v_first else init).clone().reshape(N, HV, K, V)

    o = torch.zeros(Ttot, HV, V, dtype=torch.float32)
    starts = cu[:-1]
    lens = cu[1:] - starts
    if N > 0 and bool((lens == 1).all()):
        rows = starts
        o[rows], S = kda_recurrent_step(S, qf[rows], kf[rows], vf[rows], gf[rows], bf[rows])
    else:
        max_len = int(lens.max()) if N > 0 else 0
        for t in range(max_len):
            act = (lens > t).nonzero(as_tuple=True)[0]
            rows = starts[act] + t
            o[rows], S_new = kda_recurrent_step(S[act], qf[rows], kf[rows], vf[rows], gf[rows], bf[rows])
            S[act] = S_new
    o = o.reshape(B, T, HV, V).to(v.dtype)
    final = None
    if output_final_state:
        final = S.transpose(-1, -2).contiguous() if state_v_first else S
    return o, final
