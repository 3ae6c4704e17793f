"""Checkpoint codec and state-movement kernels: Triton on CUDA, the pure-torch reference elsewhere.

Functions (all batched over (src_slot, dst_slot) pairs, one launch for all layers):

* ``quant_scatter``      active fp32 slots  -> int8 checkpoint slots (+ conv in native dtype)
* ``gather_dequant``     int8 checkpoint    -> active slots (dequantized into the active dtype)
* ``copy_to_ckpt``       active slots       -> fp32/bf16 checkpoint slots (cast; fp32 is bit-exact)
* ``copy_from_ckpt``     fp32/bf16 ckpt     -> active slots (COW)
* ``store_intermediate`` chunk_kda's bf16 ``h[i]`` -> one layer of checkpoint slots (int8 or native),
  straight from ``h`` with no full-precision copy in between, plus the conv window at the boundary
  gathered from the layer's pre-conv token stream.

The storing functions return ``bad: bool[n_pairs]`` (True: a NaN/Inf in the source, or the stored
value would be non-finite). Callers must refuse those slots; the data is still written.

Why per-(layer, head, k) scales reduced over V (not over K, not finer):
KDA's recurrence is ``S <- diag(exp(g)) S + beta k (v - S^T k)^T`` in fla's [K, V] orientation, so
the decay acts per k-row: rows with small cumulative gates decay together and have a common
magnitude, while magnitudes differ from one k-row to the next. A scale per k-row over V
follows that structure (upstream chose the same axis). ``tests/test_ckpt_codec.py`` measures it on
states produced by fla's ``naive_recurrent_kda`` (2 x 2 heads x 128 x 128, 192 tokens): per-k
scales give 0.63% relative round-trip error against 0.91% for per-v scales; splitting V into 4
groups gives 0.53% (a 17% gain) for 4x the scale bytes (12.5% of an int8 checkpoint instead of
3%) and a smaller tile per scale. bf16 is 0.17% at twice the bytes. We keep per-(head, k).
"""

from __future__ import annotations

import torch

from . import reference as ref

try:  # Triton is optional on CPU-only installs
    from . import triton_kernels as _tk
except Exception:  # pragma: no cover - import guard
    _tk = None


def triton_available(t: torch.Tensor) -> bool:
    return _tk is not None and t.is_cuda


def _use_triton(t: torch.Tensor, use_triton) -> bool:
    if use_triton is None:
        return triton_available(t)
    if use_triton and not triton_available(t):
        raise RuntimeError("Triton path requested for a non-CUDA tensor or without Triton")
    return bool(use_triton)


def quant_scatter(
    src_temporal, src_conv, src_slots, dst_q, dst_scale, dst_conv, dst_slots, *, use_triton=None, **kw
) -> torch.Tensor:
    if _use_triton(src_temporal, use_triton):
        return _tk.quant_scatter(src_temporal, src_conv, src_slots, dst_q, dst_scale, dst_conv, dst_slots, **kw)
    return ref.quant_scatter_ref(src_temporal, src_conv, src_slots, dst_q, dst_scale, dst_conv, dst_slots)


def gather_dequant(
    src_q, src_scale, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, *, use_triton=None, **kw
) -> None:
    if _use_triton(src_q, use_triton):
        return _tk.gather_dequant(src_q, src_scale, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, **kw)
    return ref.gather_dequant_ref(src_q, src_scale, src_conv, src_slots, dst_temporal, dst_conv, dst_slots)


def copy_to_ckpt(
    src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, *, use_triton=None, **kw
) -> torch.Tensor:
    if _use_triton(src_temporal, use_triton):
        return _tk.copy_to_ckpt(src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, **kw)
    return ref.copy_to_ckpt_ref(src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots)


def copy_from_ckpt(
    src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, *, use_triton=None, **kw
) -> None:
    if _use_triton(src_temporal, use_triton):
        return _tk.copy_from_ckpt(src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots, **kw)
    return ref.copy_from_ckpt_ref(src_temporal, src_conv, src_slots, dst_temporal, dst_conv, dst_slots)


def store_intermediate(
    h,
    chunk_idx,
    layer,
    dst_q,
    dst_scale,
    dst_slots,
    *,
    state_v_first=False,
    conv_src=None,
    token_ends=None,
    dst_conv=None,
    use_triton=None,
    **kw,
) -> torch.Tensor:
    if _use_triton(h, use_triton):
        return _tk.store_intermediate(
            h,
            chunk_idx,
            layer,
            dst_q,
            dst_scale,
            dst_slots,
            state_v_first=state_v_first,
            conv_src=conv_src,
            token_ends=token_ends,
            dst_conv=dst_conv,
            **kw,
        )
    return ref.store_intermediate_ref(
        h,
        chunk_idx,
        layer,
        dst_q,
        dst_scale,
        dst_slots,
        state_v_first=state_v_first,
        conv_src=conv_src,
        token_ends=token_ends,
        dst_conv=dst_conv,
    )


def intermediate_chunk_index(chunk_offsets, seq: int, n_tokens: int, chunk_size: int = 64) -> int:
    """Index into chunk_kda's flattened ``h`` of the state after ``n_tokens`` tokens of sequence
    ``seq``. ``chunk_offsets[seq]`` is the sequence's first chunk (varlen: fla's
    ``prepare_chunk_offsets(cu_seqlens, 64)``; equal lengths: ``seq * NT``). ``n_tokens`` must be a
    multiple of ``chunk_size`` and smaller than the sequence length (the state after the whole
    sequence is chunk_kda's final state, not an ``h`` entry)."""
    if n_tokens % chunk_size:
        raise ValueError(f"n_tokens={n_tokens} is not a multiple of the chunk size {chunk_size}")
    return int(chunk_offsets[seq]) + n_tokens // chunk_size


__all__ = [
    "quant_scatter",
    "gather_dequant",
    "copy_to_ckpt",
    "copy_from_ckpt",
    "store_intermediate",
    "intermediate_chunk_index",
    "triton_available",
    "ref",
]
