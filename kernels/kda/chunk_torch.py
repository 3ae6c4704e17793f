"""Chunked KDA forward in pure torch (the CPU prefill/extend path).

Math (per value head, state ``S`` is ``[K, V]``; ``g`` is the per-channel log decay):

    S_t = diag(exp(g_t)) S_{t-1} + beta_t k_t (v_t - k_t^T diag(exp(g_t)) S_{t-1})^T
    o_t = scale * q_t^T S_t

Chunked form over chunks of ``BT = 64`` tokens (``gc`` = cumulative log decay inside the chunk):

    L[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(gc_i[d] - gc_j[d])      (j < i)
    [w | u]   = (I + L)^{-1} [beta * exp(gc) * k | beta * v]            (UT transform)
    v_new     = u - w S
    o         = (q * exp(gc)) S + Aqk v_new,   Aqk[i, j] = sum_d q_i k_j exp(gc_i - gc_j)  (j <= i)
    S'        = diag(exp(gc_last)) S + (exp(gc_last - gc) * k)^T v_new

Every exponent is formed as a difference that is ``<= 0`` (``gc`` is non-increasing), so nothing
overflows however strong the decay: off-diagonal 8x8 blocks of ``L``/``Aqk`` factor through the
last token of the earlier block, diagonal blocks are computed pairwise.

Varlen batches are packed chunk by chunk (no padding to the longest sequence); only the
chunk-to-chunk state recurrence is sequential, and it runs over all sequences at once.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gate_torch import l2norm

CHUNK_SIZE = 64
_SUB = 8  # sub-block size for the factorized intra-chunk scores


def _seq_lens(cu_seqlens: torch.Tensor) -> list[int]:
    cu = cu_seqlens.tolist()
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE):
    """Packed chunk layout of a varlen batch.

    Returns ``(chunk_seq, chunk_pos, chunk_offsets, tok_idx)``: for each chunk its sequence and its
    position inside the sequence; ``chunk_offsets[n]`` = index of sequence ``n``'s first chunk
    (length ``N + 1``); ``tok_idx`` ``[NC, chunk_size]`` = token row of each chunk slot, ``-1`` past
    the end of the sequence. Chunks are ordered by sequence, then position (upstream's packing).
    """
    cu = cu_seqlens.tolist()
    seqs, poss, rows = [], [], []
    offsets = [0]
    ar = torch.arange(chunk_size)
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        nc = (eos - bos + chunk_size - 1) // chunk_size
        for c in range(nc):
            start = bos + c * chunk_size
            r = start + ar
            r = torch.where(r < eos, r, torch.full_like(r, -1))
            rows.append(r)
            seqs.append(n)
            poss.append(c)
        offsets.append(offsets[-1] + nc)
    tok_idx = torch.stack(rows) if rows else torch.empty(0, chunk_size, dtype=torch.long)
    return (
        torch.tensor(seqs, dtype=torch.long),
        torch.tensor(poss, dtype=torch.long),
        torch.tensor(offsets, dtype=torch.long),
        tok_idx,
    )


def _gather_chunks(x: torch.Tensor, tok_idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` -> ``[NC, H, BT, D]`` with zeros past each sequence's end."""
    pad = x.new_zeros((1,) + tuple(x.shape[1:]))
    xp = torch.cat([x, pad], 0)
    idx = torch.where(tok_idx >= 0, tok_idx, torch.full_like(tok_idx, x.shape[0]))
    return xp[idx].transpose(1, 2)  # [NC, BT, H, D] -> [NC, H, BT, D]


def gated_scores(a: torch.Tensor, k: torch.Tensor, gc: torch.Tensor, strict: bool) -> torch.Tensor:
    """``A[..., i, j] = sum_d a_i[d] k_j[d] exp(gc_i[d] - gc_j[d])`` for ``j < i`` (``j <= i`` unless
    ``strict``), zero above. ``a, k, gc``: ``[..., BT, D]`` with ``gc`` non-increasing along BT."""
    BT, D = gc.shape[-2], gc.shape[-1]
    S = _SUB if BT % _SUB == 0 else BT
    NS = BT // S
    out = a.new_zeros(a.shape[:-1] + (BT,))
    # Off-diagonal blocks (rows in a later block than the columns): both factors are <= 1.
    for J in range(NS - 1):
        cols = slice(J * S, (J + 1) * S)
        rows = slice((J + 1) * S, BT)
        ref = gc[..., (J + 1) * S - 1 : (J + 1) * S, :]
        kj = k[..., cols, :] * torch.exp(ref - gc[..., cols, :])
        ai = a[..., rows, :] * torch.exp(gc[..., rows, :] - ref)
        out[..., rows, cols] = ai @ kj.transpose(-1, -2)
    # Diagonal blocks, pairwise (exponent clamped at 0 for the masked upper part).
    shp = a.shape[:-2] + (NS, S, D)
    ab, kb, gb = a.reshape(shp), k.reshape(shp), gc.reshape(shp)
    diag = a.new_empty(a.shape[:-2] + (NS, S, S))
    for j in range(S):
        e = torch.exp(torch.clamp(gb - gb[..., j : j + 1, :], max=0.0))
        diag[..., j] = (ab * e * kb[..., j : j + 1, :]).sum(-1)
    mask = torch.ones(S, S, dtype=torch.bool).tril(-1 if strict else 0)
    diag = diag * mask
    for I in range(NS):
        blk = slice(I * S, (I + 1) * S)
        out[..., blk, blk] = diag[..., I, :, :]
    return out


def chunk_kda_torch(
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
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    chunk_size: int = CHUNK_SIZE,
):
    """Chunked KDA forward (fla ``chunk_kda`` contract, activated gates).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``);
        g: log-space decay (already activated, NOT cumsummed) ``[B, T, HV, K]``;
        beta: post-sigmoid ``[B, T, HV]``;
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), or None for zeros;
        cu_seqlens: ``[N + 1]`` cumulative lengths (then ``B == 1``); else ``N = B``.
    Returns:
        ``(o, final_state)`` or, with ``return_intermediate_states``, ``(o, final_state, h)``:
        ``o`` ``[B, T, HV, V]`` in ``v.dtype``; ``final_state`` fp32 ``[N, HV, K, V]`` (or V-first)
        when ``output_final_state`` else None; ``h`` fp32 ``[B', NT, HV, K, V]`` (or V-first) where
        ``h[:, chunk_offsets[n] + i]`` is sequence ``n``'s state after ``chunk_size * i`` of its
        tokens (``i = 0`` is the initial state; the state after the last chunk is ``final_state``).
        With ``cu_seqlens``, ``B' = 1`` and NT counts the chunks of all sequences.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    assert HV % H == 0, "HV must be a multiple of H"
    G = HV // H
    if scale is None:
        scale = K**-0.5
    varlen = cu_seqlens is not None
    if varlen:
        assert B == 1, "cu_seqlens requires batch size 1"
        cu = cu_seqlens.to(torch.long).cpu()
    else:
        cu = torch.arange(0, B * T + 1, T, dtype=torch.long) if T > 0 else torch.zeros(B + 1, dtype=torch.long)
    N = cu.numel() - 1
    Ttot = B * T
    BT = chunk_size

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

    chunk_seq, chunk_pos, chunk_offsets, tok_idx = chunk_layout(cu, BT)
    NC = tok_idx.shape[0]

    S = q.new_zeros(N, HV, K, V, dtype=torch.float32)
    if initial_state is not None:
        init = initial_state.float()
        S = (init.transpose(-1, -2) if state_v_first else init).clone().reshape(N, HV, K, V)

    o = torch.zeros(Ttot, HV, V, dtype=torch.float32)
    h = torch.empty(NC, HV, K, V, dtype=torch.float32) if return_intermediate_states else None

    if NC > 0:
        qc = _gather_chunks(qf, tok_idx)  # [NC, HV, BT, K]
        kc = _gather_chunks(kf, tok_idx)
        vc = _gather_chunks(vf, tok_idx)  # [NC, HV, BT, V]
        gc = _gather_chunks(gf, tok_idx).cumsum(2)  # padded rows have g = 0: gc stays flat
        bc = _gather_chunks(bf.unsqueeze(-1), tok_idx)  # [NC, HV, BT, 1]; 0 on padding

        L = gated_scores(kc, kc, gc, strict=True) * bc  # row i scaled by beta_i
        eye = torch.eye(BT, dtype=torch.float32)
        rhs = torch.cat([bc * torch.exp(gc) * kc, bc * vc], -1)
        wu = torch.linalg.solve_triangular(L + eye, rhs, upper=False, unitriangular=True)
        w, u = wu[..., :K], wu[..., K:]
        Aqk = gated_scores(qc, kc, gc, strict=False)
        g_last = gc[:, :, -1:, :]  # [NC, HV, 1, K]
        qg = qc * torch.exp(gc)
        kdec = (kc * torch.exp(g_last - gc)).transpose(-1, -2)  # [NC, HV, K, BT]
        decay = torch.exp(g_last).transpose(-1, -2)  # [NC, HV, K, 1]
        del L, rhs, wu

        vnew = torch.empty_like(u)
        h_all = torch.empty(NC, HV, K, V, dtype=torch.float32)
        max_pos = int(chunk_pos.max()) + 1
        for p in range(max_pos):
            sel = (chunk_pos == p).nonzero(as_tuple=True)[0]
            seqs = chunk_seq[sel]
            Sp = S[seqs]
            h_all[sel] = Sp
            vn = u[sel] - w[sel] @ Sp
            vnew[sel] = vn
            S[seqs] = Sp * decay[sel] + kdec[sel] @ vn
        oc = qg @ h_all + Aqk @ vnew  # [NC, HV, BT, V]
        oc = oc.transpose(1, 2).reshape(NC * BT, HV, V)
        flat = tok_idx.reshape(-1)
        valid = flat >= 0
        o[flat[valid]] = oc[valid]
        if h is not None:
            h = h_all

    o = o.reshape(B, T, HV, V).to(v.dtype)
    final = None
    if output_final_state:
        final = S.transpose(-1, -2).contiguous() if state_v_first else S
    if not return_intermediate_states:
        return o, final
    if state_v_first:
        h = h.transpose(-1, -2).contiguous()
    if varlen:
        h = h.unsqueeze(0)
    else:
        h = h.reshape(B, NC // B if B else 0, HV, *h.shape[-2:])
    return o, final, h
