"""Pure-torch references for the checkpoint codec. These are the CPU path and the oracle the
Triton kernels are tested against.

Layouts (all index math is by explicit slot index, never by position in the batch):

* active temporal : ``[L, S_act, H, V, K]`` (upstream ``MambaPool.State.temporal``: KDA's
  ``ssm_states`` are ``[slots, HV, V, K]`` per layer), fp32 (or bf16).
* active conv     : ``[L, S_act, *conv_shape]`` native dtype (upstream ``State.conv[i]``).
* checkpoint q    : ``[S_ck, L, H, V, K]`` int8 / bf16 / fp32. Slot-major, so that one checkpoint
  is one contiguous block per tensor (a tier moves it with a single copy).
* checkpoint scale: ``[S_ck, L, H, K]`` fp32 (int8 only): one scale per (layer, head, k-channel),
  taken over V. See ``kernels/ckpt/__init__.py`` for why this axis.
* checkpoint conv : ``[S_ck, L, conv_numel]`` in the active conv dtype.

Quantization (shared bit-for-bit with the Triton kernel):
``amax = max_v |x[v, k]|``; ``scale = amax / 127``; ``inv = 127 / amax`` (0 when amax <= TINY);
``q = clamp(rint(x * inv), -127, 127)``; dequant ``x' = q * scale``. All in fp32.
Columns whose amax is below ``TINY`` (1e-30) are stored as zeros.

Non-finite check: a pair is *bad* when any source element (temporal or conv) is NaN/Inf, or when
the stored value would be non-finite (bf16 overflow). The references return a bool tensor
``bad[n_pairs]``; the data of bad pairs is still written (the pool refuses those slots).
"""

from __future__ import annotations

from typing import Optional

import torch

QMAX = 127.0
TINY = 1e-30


def _as_idx(idx, device) -> torch.Tensor:
    return torch.as_tensor(idx, dtype=torch.long, device=device).reshape(-1)


def quantize_tile(x: torch.Tensor):
    """x [..., V, K] -> (q int8 [..., V, K], scale fp32 [..., K]); scale reduces over V."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-2)
    ok = amax > TINY
    scale = torch.where(ok, torch.div(amax, torch.full_like(amax, QMAX)), torch.zeros_like(amax))
    # torch.div(tensor, tensor), not `127 / t`: Tensor.__rtruediv__ is reciprocal()*127, which
    # differs from an IEEE division by an ulp and would flip round-half cases against the kernel
    inv = torch.where(
        ok, torch.div(torch.full_like(amax, QMAX), torch.where(ok, amax, torch.ones_like(amax))), torch.zeros_like(amax)
    )
    q = torch.round(xf * inv.unsqueeze(-2)).clamp_(-QMAX, QMAX)
    q = torch.nan_to_num(q, nan=0.0).to(torch.int8)
    return q, scale


def dequantize_tile(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.unsqueeze(-2).to(torch.float32)


def _nonfinite_per_pair(*tensors: torch.Tensor) -> torch.Tensor:
    """Each tensor [n_pairs, ...]; returns bool [n_pairs]."""
    bad = None
    for t in tensors:
        if t is None:
            continue
        b = ~torch.isfinite(t.reshape(t.shape[0], -1).to(torch.float32)).all(dim=1)
        bad = b if bad is None else (bad | b)
    return bad


def _conv_to_ckpt(src_conv, si, dst_conv, di) -> torch.Tensor:
    """Active conv ``[L, S, *shape]`` slots ``si`` -> checkpoint conv ``[S', L, numel]`` slots
    ``di`` in the checkpoint's dtype (the conv state is never quantized). Returns the source rows
    ``[N, L, numel]`` for the non-finite check."""
    c = src_conv.index_select(1, si).transpose(0, 1).reshape(len(si), src_conv.shape[0], -1)
    dst_conv.index_copy_(0, di.to(dst_conv.device), c.to(dst_conv.dtype))
    return c


def _conv_from_ckpt(src_conv, si, dst_conv, di) -> None:
    """Checkpoint conv ``[S', L, numel]`` slots ``si`` -> active conv ``[L, S, *shape]`` slots ``di``."""
    c = src_conv.index_select(0, si).transpose(0, 1)  # [L, N, numel]
    dst_conv.index_copy_(1, di.to(dst_conv.device), c.reshape(c.shape[:2] + dst_conv.shape[2:]).to(dst_conv.dtype))


def quant_scatter_ref(
    src_temporal: torch.Tensor,
    src_conv: Optional[torch.Tensor],
    src_slots,
    dst_q: torch.Tensor,
    dst_scale: torch.Tensor,
    dst_conv: Optional[torch.Tensor],
    dst_slots,
) -> torch.Tensor:
    """Active (layer-major) -> int8 checkpoint (slot-major). Returns bad[n_pairs] (bool)."""
    dev = src_temporal.device
    si, di = _as_idx(src_slots, dev), _as_idx(dst_slots, dev)
    x = src_temporal.index_select(1, si).transpose(0, 1)  # [N, L, H, V, K]
    q, scale = quantize_tile(x)
    dst_q.index_copy_(0, di.to(dst_q.device), q)
    dst_scale.index_copy_(0, di.to(dst_q.device), scale)
    c = None
    if src_conv is not None:
        c = _conv_to_ckpt(src_conv, si, dst_conv, di)
    return _nonfinite_per_pair(x, c)


def gather_dequant_ref(
    src_q: torch.Tensor,
    src_scale: torch.Tensor,
    src_conv: Optional[torch.Tensor],
    src_slots,
    dst_temporal: torch.Tensor,
    dst_conv: Optional[torch.Tensor],
    dst_slots,
) -> None:
    """int8 checkpoint (slot-major) -> active (layer-major), dequantized into dst's dtype."""
    dev = src_q.device
    si, di = _as_idx(src_slots, dev), _as_idx(dst_slots, dev)
    x = dequantize_tile(src_q.index_select(0, si), src_scale.index_select(0, si))  # [N, L, H, V, K]
    dst_temporal.index_copy_(1, di.to(dst_temporal.device), x.transpose(0, 1).to(dst_temporal.dtype))
    if src_conv is not None:
        _conv_from_ckpt(src_conv, si, dst_conv, di)


def copy_to_ckpt_ref(
    src_temporal: torch.Tensor,
    src_conv: Optional[torch.Tensor],
    src_slots,
    dst_temporal: torch.Tensor,
    dst_conv: Optional[torch.Tensor],
    dst_slots,
) -> torch.Tensor:
    """Active (layer-major) -> fp32/bf16 checkpoint (slot-major), cast to the checkpoint dtype.
    Returns bad[n_pairs] (non-finite source or non-finite after the cast)."""
    dev = src_temporal.device
    si, di = _as_idx(src_slots, dev), _as_idx(dst_slots, dev)
    x = src_temporal.index_select(1, si).transpose(0, 1)
    xc = x.to(dst_temporal.dtype)
    dst_temporal.index_copy_(0, di, xc)
    c = None
    if src_conv is not None:
        c = _conv_to_ckpt(src_conv, si, dst_conv, di)
    return _nonfinite_per_pair(x, xc, c)


def copy_from_ckpt_ref(
    src_temporal: torch.Tensor,
    src_conv: Optional[torch.Tensor],
    src_slots,
    dst_temporal: torch.Tensor,
    dst_conv: Optional[torch.Tensor],
    dst_slots,
) -> None:
    """fp32/bf16 checkpoint (slot-major) -> active (layer-major), cast to the active dtype (COW)."""
    dev = src_temporal.device
    si, di = _as_idx(src_slots, dev), _as_idx(dst_slots, dev)
    x = src_temporal.index_select(0, si).transpose(0, 1)
    dst_temporal.index_copy_(1, di, x.to(dst_temporal.dtype))
    if src_conv is not None:
        _conv_from_ckpt(src_conv, si, dst_conv, di)


def conv_windows_ref(conv_src: torch.Tensor, token_ends, width: int) -> torch.Tensor:
    """Conv windows at boundaries from a token stream: conv_src [T, D] (the pre-conv inputs of one
    layer, flattened over sequences), token_ends [N] absolute positions; window row j of pair n is
    ``conv_src[token_ends[n] - width + j]`` (oldest first). Returns [N, width, D]."""
    te = _as_idx(token_ends, conv_src.device)
    rows = te[:, None] - width + torch.arange(width, device=conv_src.device)[None, :]
    if (rows < 0).any():
        raise ValueError("a boundary is closer than the conv width to the stream start")
    return conv_src[rows]


def store_intermediate_ref(
    h: torch.Tensor,
    chunk_idx,
    layer,
    dst_q: torch.Tensor,
    dst_scale: Optional[torch.Tensor],
    dst_slots,
    *,
    state_v_first: bool = False,
    conv_src: Optional[torch.Tensor] = None,
    token_ends=None,
    dst_conv: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """chunk_kda intermediate states -> layer ``layer`` of checkpoint slots.

    h: ``[B, NT, HV, K, V]`` (fla default) or ``[B, NT, HV, V, K]`` (``state_v_first``), bf16;
    ``chunk_idx`` indexes the flattened ``B*NT`` axis (h[b, i] = state after 64*i tokens of
    sequence b; for varlen B == 1 and the index is chunk_offsets[seq] + n_tokens // 64).
    ``dst_scale`` None means a native (bf16/fp32) checkpoint. Returns bad[n_pairs].

    Several layers at once: ``layer`` a sequence of layer indices, ``h`` with a leading axis of
    that length (``[n_layers, R, HV, *, *]``, ``chunk_idx`` indexing ``R``) and ``conv_src``
    ``[n_layers, T, D]``; a pair is bad if any of its layers is."""
    if not isinstance(layer, int):
        layers = [int(x) for x in layer]
        if h.shape[0] != len(layers) or (conv_src is not None and conv_src.shape[0] != len(layers)):
            raise ValueError("h and conv_src need one leading entry per layer")
        bad = None
        for i, li in enumerate(layers):
            b = store_intermediate_ref(
                h[i],
                chunk_idx,
                li,
                dst_q,
                dst_scale,
                dst_slots,
                state_v_first=state_v_first,
                conv_src=None if conv_src is None else conv_src[i],
                token_ends=token_ends,
                dst_conv=dst_conv,
            )
            bad = b if bad is None else bad | b
        return bad
    dev = h.device
    ci, di = _as_idx(chunk_idx, dev), _as_idx(dst_slots, dev)
    hf = h.reshape((-1,) + tuple(h.shape[-3:])).index_select(0, ci)
    if not state_v_first:
        hf = hf.transpose(-1, -2)  # -> [N, HV, V, K]
    c = None
    if conv_src is not None:
        c = conv_windows_ref(conv_src, token_ends, dst_conv.shape[-1] // conv_src.shape[-1])
        dst_conv[di, layer] = c.reshape(len(di), -1).to(dst_conv.dtype)
    if dst_scale is not None:
        q, scale = quantize_tile(hf)
        dst_q[di, layer] = q
        dst_scale[di, layer] = scale
        return _nonfinite_per_pair(hf, c)
    xc = hf.to(dst_q.dtype)
    dst_q[di, layer] = xc
    return _nonfinite_per_pair(hf, xc, c)
