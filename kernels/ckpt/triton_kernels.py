"""Triton kernels for the checkpoint codec (CUDA path). Each kernel equals its reference in
``reference.py`` (bit-exact for int8 codes, scales, copies and dequantized values).

One launch covers every (pair, layer): the layers are the leading axis of upstream's stacked
``MambaPool`` tensors (``temporal [L, S, H, V, K]``, ``conv[i] [L, S, ...]``), so a layer is just a
stride. No pointer table is needed (and none would be cheaper: a table costs one extra dependent
load per program). The grid is ``(tiles + conv_blocks, L, n_pairs)``: programs below ``tiles`` each
own one ``[V, BK]`` tile of one head (a whole V column, so the per-(layer, head, k) scale is
reduced in registers, no second pass, no atomics), the rest copy ``BC`` elements of the conv state
of the same (pair, layer) in its native dtype.

Index arithmetic is int64 (a K3 active pool exceeds 2**31 elements).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)


if os.environ.get("TRITON_INTERPRET", "0") == "1":

    @triton.jit
    def _rint(y):
        # round half to even, exact for |y| < 2**22: the interpreter has no libdevice
        f = tl.floor(y)
        diff = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        up = (diff > 0.5) | ((diff == 0.5) & odd)
        return tl.where(up, f + 1.0, f)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _rint(y):
        return libdevice.rint(y)  # one cvt.rni: round half to even, as torch.round


@triton.jit
def _conv_copy_part(
    cs_ptr, cs_sl, cs_ss, cd_ptr, cd_sl, cd_ss, l, s, d, cb, CONV_N, BC: tl.constexpr, CHECK: tl.constexpr
):
    offs = cb * BC + tl.arange(0, BC)
    m = offs < CONV_N
    c = tl.load(cs_ptr + l * cs_sl + s * cs_ss + offs, mask=m, other=0.0)
    tl.store(cd_ptr + l * cd_sl + d * cd_ss + offs, c.to(cd_ptr.dtype.element_ty), mask=m)
    nbad = (cb * 0).to(tl.int32)
    if CHECK:
        cf = c.to(tl.float32)
        nbad = tl.sum(tl.where(tl.abs(cf) <= FLT_MAX, 0, 1))
    return nbad.to(tl.int32)


@triton.jit
def _quant_scatter_kernel(
    x_ptr,
    x_sl,
    x_ss,
    q_ptr,
    q_sl,
    q_ss,
    sc_ptr,
    sc_sl,
    sc_ss,
    cs_ptr,
    cs_sl,
    cs_ss,
    cd_ptr,
    cd_sl,
    cd_ss,
    src_idx_ptr,
    dst_idx_ptr,
    bad_ptr,
    CONV_N,
    H: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    VP: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    HAS_CONV: tl.constexpr,
):
    pid = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    s = tl.load(src_idx_ptr + p).to(tl.int64)
    d = tl.load(dst_idx_ptr + p).to(tl.int64)
    NKB: tl.constexpr = (K + BK - 1) // BK
    if pid < H * NKB:
        h = pid // NKB
        kb = pid % NKB
        ov = tl.arange(0, VP)
        ok = kb * BK + tl.arange(0, BK)
        m = (ov[:, None] < V) & (ok[None, :] < K)
        inner = h * (V * K) + ov[:, None] * K + ok[None, :]
        x = tl.load(x_ptr + l * x_sl + s * x_ss + inner, mask=m, other=0.0).to(tl.float32)
        # NaN counts as +Inf in the column max: a NaN/Inf anywhere in the tile shows up in amax,
        # so the non-finite check is a reduction over BK values, not over the whole tile
        ax = tl.where(x == x, tl.abs(x), float("inf"))
        amax = tl.max(ax, axis=0)
        nbad = tl.sum(tl.where(amax <= FLT_MAX, 0, 1))
        okk = amax > 1e-30
        scale = tl.where(okk, tl.math.div_rn(amax, 127.0), 0.0)
        inv = tl.where(okk, tl.math.div_rn(127.0, tl.where(okk, amax, 1.0)), 0.0)
        # |x * inv| <= 127 * (1 + 2**-23) so rint stays in [-127, 127]: no clamp needed
        qf = _rint(x * inv[None, :])
        tl.store(q_ptr + l * q_sl + d * q_ss + inner, qf.to(tl.int8), mask=m)
        tl.store(sc_ptr + l * sc_sl + d * sc_ss + h * K + ok, scale, mask=ok < K)
    else:
        nbad = pid * 0
        if HAS_CONV:
            nbad = _conv_copy_part(cs_ptr, cs_sl, cs_ss, cd_ptr, cd_sl, cd_ss, l, s, d, pid - H * NKB, CONV_N, BC, True)
    if nbad > 0:
        tl.store(bad_ptr + p, 1)


@triton.jit
def _gather_dequant_kernel(
    q_ptr,
    q_sl,
    q_ss,
    sc_ptr,
    sc_sl,
    sc_ss,
    y_ptr,
    y_sl,
    y_ss,
    cs_ptr,
    cs_sl,
    cs_ss,
    cd_ptr,
    cd_sl,
    cd_ss,
    src_idx_ptr,
    dst_idx_ptr,
    CONV_N,
    H: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    VP: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    HAS_CONV: tl.constexpr,
):
    pid = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    s = tl.load(src_idx_ptr + p).to(tl.int64)
    d = tl.load(dst_idx_ptr + p).to(tl.int64)
    NKB: tl.constexpr = (K + BK - 1) // BK
    if pid < H * NKB:
        h = pid // NKB
        kb = pid % NKB
        ov = tl.arange(0, VP)
        ok = kb * BK + tl.arange(0, BK)
        m = (ov[:, None] < V) & (ok[None, :] < K)
        inner = h * (V * K) + ov[:, None] * K + ok[None, :]
        q = tl.load(q_ptr + l * q_sl + s * q_ss + inner, mask=m, other=0).to(tl.float32)
        sc = tl.load(sc_ptr + l * sc_sl + s * sc_ss + h * K + ok, mask=ok < K, other=0.0)
        y = q * sc[None, :]
        tl.store(y_ptr + l * y_sl + d * y_ss + inner, y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        if HAS_CONV:
            _conv_copy_part(cs_ptr, cs_sl, cs_ss, cd_ptr, cd_sl, cd_ss, l, s, d, pid - H * NKB, CONV_N, BC, False)


@triton.jit
def _slot_copy_kernel(
    x_ptr,
    x_sl,
    x_ss,
    y_ptr,
    y_sl,
    y_ss,
    cs_ptr,
    cs_sl,
    cs_ss,
    cd_ptr,
    cd_sl,
    cd_ss,
    src_idx_ptr,
    dst_idx_ptr,
    bad_ptr,
    N,
    CONV_N,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_CONV: tl.constexpr,
    CHECK: tl.constexpr,
):
    pid = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    s = tl.load(src_idx_ptr + p).to(tl.int64)
    d = tl.load(dst_idx_ptr + p).to(tl.int64)
    NB = tl.cdiv(N, BT)
    if pid < NB:
        offs = pid * BT + tl.arange(0, BT)
        m = offs < N
        x = tl.load(x_ptr + l * x_sl + s * x_ss + offs, mask=m, other=0.0)
        y = x.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + l * y_sl + d * y_ss + offs, y, mask=m)
        nbad = pid * 0
        if CHECK:
            # the source and the value stored: catches NaN/Inf and bf16 overflow alike
            if y_ptr.dtype.element_ty == x_ptr.dtype.element_ty:
                a = tl.abs(x.to(tl.float32))
            else:
                a = tl.maximum(tl.abs(x.to(tl.float32)), tl.abs(y.to(tl.float32)))
                a = tl.where(x == x, a, float("inf"))
            nbad = tl.sum(tl.where(a <= FLT_MAX, 0, 1))
    else:
        nbad = pid * 0
        if HAS_CONV:
            nbad = _conv_copy_part(cs_ptr, cs_sl, cs_ss, cd_ptr, cd_sl, cd_ss, l, s, d, pid - NB, CONV_N, BC, CHECK)
    if CHECK and nbad > 0:
        tl.store(bad_ptr + p, 1)


@triton.jit
def _store_intermediate_kernel(
    h_ptr,
    h_sl,
    h_sc,
    h_sh,
    h_sv,
    h_sk,
    q_ptr,
    q_sl,
    q_ss,
    sc_ptr,
    sc_sl,
    sc_ss,
    t_ptr,
    t_sl,
    t_st,
    cd_ptr,
    cd_sl,
    cd_ss,
    chunk_idx_ptr,
    dst_idx_ptr,
    tok_ptr,
    bad_ptr,
    CONV_N,
    CONV_D,
    CONV_W,
    H: tl.constexpr,
    V: tl.constexpr,
    K: tl.constexpr,
    VP: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_CONV: tl.constexpr,
):
    # q_ptr / sc_ptr / cd_ptr point at the first target layer of slot 0; program_id(2) is the
    # layer within the stack (h and the token stream have one leading entry per layer)
    pid = tl.program_id(0)
    p = tl.program_id(1)
    l = tl.program_id(2).to(tl.int64)
    c = tl.load(chunk_idx_ptr + p).to(tl.int64)
    d = tl.load(dst_idx_ptr + p).to(tl.int64)
    NKB: tl.constexpr = (K + BK - 1) // BK
    if pid < H * NKB:
        h = pid // NKB
        kb = pid % NKB
        ov = tl.arange(0, VP)
        ok = kb * BK + tl.arange(0, BK)
        m = (ov[:, None] < V) & (ok[None, :] < K)
        src = h_ptr + l * h_sl + c * h_sc + h * h_sh + ov[:, None] * h_sv + ok[None, :] * h_sk
        x = tl.load(src, mask=m, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        inner = h * (V * K) + ov[:, None] * K + ok[None, :]
        if QUANT:
            ax = tl.where(x == x, ax, float("inf"))
            amax = tl.max(ax, axis=0)
            nbad = tl.sum(tl.where(amax <= FLT_MAX, 0, 1))
            okk = amax > 1e-30
            scale = tl.where(okk, tl.math.div_rn(amax, 127.0), 0.0)
            inv = tl.where(okk, tl.math.div_rn(127.0, tl.where(okk, amax, 1.0)), 0.0)
            qf = _rint(x * inv[None, :])
            tl.store(q_ptr + l * q_sl + d * q_ss + inner, qf.to(tl.int8), mask=m)
            tl.store(sc_ptr + l * sc_sl + d * sc_ss + h * K + ok, scale, mask=ok < K)
        else:
            y = x.to(q_ptr.dtype.element_ty)
            b = tl.abs(y.to(tl.float32))
            nbad = tl.sum(tl.sum(tl.where((ax <= FLT_MAX) & (b <= FLT_MAX), 0, 1), axis=1), axis=0)
            tl.store(q_ptr + l * q_sl + d * q_ss + inner, y, mask=m)
    else:
        nbad = pid * 0
        if HAS_CONV:
            te = tl.load(tok_ptr + p).to(tl.int64)
            offs = (pid - H * NKB) * BC + tl.arange(0, BC)
            mm = offs < CONV_N
            row = te - CONV_W + offs // CONV_D
            col = offs % CONV_D
            cv = tl.load(t_ptr + l * t_sl + row * t_st + col, mask=mm, other=0.0)
            tl.store(cd_ptr + l * cd_sl + d * cd_ss + offs, cv.to(cd_ptr.dtype.element_ty), mask=mm)
            cf = tl.abs(cv.to(tl.float32))
            nbad = tl.sum(tl.where(cf <= FLT_MAX, 0, 1))
    if nbad > 0:
        tl.store(bad_ptr + p, 1)


# --------------------------------------------------------------------------------------------
# wrappers: validate layouts, build the grid, launch once.


def _idx(x, device) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int32, device=device).reshape(-1)
    return t.contiguous()


def _check_inner(t: torch.Tensor, lead: int, what: str):
    shape, stride = t.shape[lead:], t.stride()[lead:]
    expect = 1
    for sz, st in zip(reversed(shape), reversed(stride)):
        if sz != 1 and st != expect:
            raise ValueError(f"{what}: the per-(layer, slot) block must be contiguous, got strides {t.stride()}")
        expect *= sz


def _conv_args(src_conv, dst_conv, src_layer_major: bool):
    if src_conv is None:
        return (None, 0, 0, None, 0, 0), 0
    _check_inner(src_conv, 2, "src conv")
    _check_inner(dst_conv, 2, "dst conv")
    n = 1
    for sz in src_conv.shape[2:]:
        n *= sz

    def ls(t, layer_major):
        return (t.stride(0), t.stride(1)) if layer_major else (t.stride(1), t.stride(0))

    return (src_conv, *ls(src_conv, src_layer_major), dst_conv, *ls(dst_conv, not src_layer_major)), n


def _flags(n, dev, bad):
    """Per-pair non-finite flags. Kernels only ever set a flag, so they need zeros to start from:
    a caller that keeps a persistent zeroed buffer (and re-zeroes it only after a hit) saves the
    memset launch per call."""
    if bad is None:
        return torch.zeros(max(n, 1), dtype=torch.int32, device=dev)
    if bad.dtype != torch.int32 or bad.numel() < n or bad.device != dev:
        raise ValueError("bad must be a zeroed int32 device tensor with at least n_pairs entries")
    return bad


def _next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def quant_scatter(
    src_temporal,
    src_conv,
    src_slots,
    dst_q,
    dst_scale,
    dst_conv,
    dst_slots,
    *,
    BK: int = 32,
    BC: int = 4096,
    num_warps: int = 2,
    bad=None,
) -> torch.Tensor:
    L, _, H, V, K = src_temporal.shape
    dev = src_temporal.device
    si, di = _idx(src_slots, dev), _idx(dst_slots, dev)
    n = si.numel()
    bad = _flags(n, dev, bad)
    if n == 0:
        return bad[:0].bool()
    _check_inner(src_temporal, 2, "active temporal")
    _check_inner(dst_q, 2, "checkpoint q")
    conv, conv_n = _conv_args(src_conv, dst_conv, True)
    tiles = H * triton.cdiv(K, BK)
    grid = (tiles + triton.cdiv(conv_n, BC), L, n)
    _quant_scatter_kernel[grid](
        src_temporal,
        src_temporal.stride(0),
        src_temporal.stride(1),
        dst_q,
        dst_q.stride(1),
        dst_q.stride(0),
        dst_scale,
        dst_scale.stride(1),
        dst_scale.stride(0),
        *conv,
        si,
        di,
        bad,
        conv_n,
        H=H,
        V=V,
        K=K,
        VP=_next_pow2(V),
        BK=BK,
        BC=BC,
        HAS_CONV=src_conv is not None,
        num_warps=num_warps,
    )
    return bad[:n].bool()


def gather_dequant(
    src_q,
    src_scale,
    src_conv,
    src_slots,
    dst_temporal,
    dst_conv,
    dst_slots,
    *,
    BK: int = 64,
    BC: int = 4096,
    num_warps: int = 8,
) -> None:
    L, _, H, V, K = dst_temporal.shape
    dev = dst_temporal.device
    si, di = _idx(src_slots, dev), _idx(dst_slots, dev)
    n = si.numel()
    if n == 0:
        return
    _check_inner(dst_temporal, 2, "active temporal")
    _check_inner(src_q, 2, "checkpoint q")
    conv, conv_n = _conv_args(src_conv, dst_conv, False)
    tiles = H * triton.cdiv(K, BK)
    grid = (tiles + triton.cdiv(conv_n, BC), L, n)
    _gather_dequant_kernel[grid](
        src_q,
        src_q.stride(1),
        src_q.stride(0),
        src_scale,
        src_scale.stride(1),
        src_scale.stride(0),
        dst_temporal,
        dst_temporal.stride(0),
        dst_temporal.stride(1),
        *conv,
        si,
        di,
        conv_n,
        H=H,
        V=V,
        K=K,
        VP=_next_pow2(V),
        BK=BK,
        BC=BC,
        HAS_CONV=src_conv is not None,
        num_warps=num_warps,
    )


def _slot_copy(
    src_t,
    src_conv,
    si,
    dst_t,
    dst_conv,
    di,
    src_layer_major: bool,
    check: bool,
    BT: int,
    BC: int,
    num_warps: int,
    bad=None,
):
    dev = src_t.device
    n = si.numel()
    bad = _flags(n, dev, bad) if check else si  # unused (never written) without the check
    if n == 0:
        return bad[:0].bool()
    _check_inner(src_t, 2, "src temporal")
    _check_inner(dst_t, 2, "dst temporal")
    L = src_t.shape[0] if src_layer_major else src_t.shape[1]
    N = 1
    for sz in src_t.shape[2:]:
        N *= sz

    def ls(t, layer_major):
        return (t.stride(0), t.stride(1)) if layer_major else (t.stride(1), t.stride(0))

    conv, conv_n = _conv_args(src_conv, dst_conv, src_layer_major)
    grid = (triton.cdiv(N, BT) + triton.cdiv(conv_n, BC), L, n)
    _slot_copy_kernel[grid](
        src_t,
        *ls(src_t, src_layer_major),
        dst_t,
        *ls(dst_t, not src_layer_major),
        *conv,
        si,
        di,
        bad,
        N,
        conv_n,
        BT=BT,
        BC=BC,
        HAS_CONV=src_conv is not None,
        CHECK=check,
        num_warps=num_warps,
    )
    return bad[:n].bool() if check else None


def copy_to_ckpt(
    src_temporal,
    src_conv,
    src_slots,
    dst_temporal,
    dst_conv,
    dst_slots,
    *,
    BT: int = 1024,
    BC: int = 4096,
    num_warps: int = 4,
    bad=None,
) -> torch.Tensor:
    dev = src_temporal.device
    return _slot_copy(
        src_temporal,
        src_conv,
        _idx(src_slots, dev),
        dst_temporal,
        dst_conv,
        _idx(dst_slots, dev),
        True,
        True,
        BT,
        BC,
        num_warps,
        bad,
    )


def copy_from_ckpt(
    src_temporal,
    src_conv,
    src_slots,
    dst_temporal,
    dst_conv,
    dst_slots,
    *,
    BT: int = 1024,
    BC: int = 4096,
    num_warps: int = 4,
) -> None:
    dev = src_temporal.device
    _slot_copy(
        src_temporal,
        src_conv,
        _idx(src_slots, dev),
        dst_temporal,
        dst_conv,
        _idx(dst_slots, dev),
        False,
        False,
        BT,
        BC,
        num_warps,
    )


def _layer_run(layer, n_stack: int) -> tuple[int, int]:
    """(first layer, layer count) of a store: an int is one layer; a sequence must be consecutive
    ascending layers (one stride), one per leading entry of the stacked h."""
    if isinstance(layer, int):
        return layer, 1
    layers = [int(x) for x in layer]
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))):
        raise ValueError(f"a multi-layer store needs consecutive ascending layers, got {layers}")
    if len(layers) != n_stack:
        raise ValueError(f"{len(layers)} layers for {n_stack} stacked h entries")
    return layers[0], len(layers)


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
    BK: int = 32,
    BC: int = 4096,
    num_warps: int = 2,
    bad=None,
) -> torch.Tensor:
    """One launch for all pairs and (with ``layer`` a sequence) all layers of the stack: see
    ``reference.store_intermediate_ref`` for the layouts."""
    H, V, K = dst_q.shape[2:]
    dev = h.device
    ci, di = _idx(chunk_idx, dev), _idx(dst_slots, dev)
    n = ci.numel()
    bad = _flags(n, dev, bad)
    if n == 0:
        return bad[:0].bool()
    multi = not isinstance(layer, int)
    first, n_layers = _layer_run(layer, h.shape[0] if multi else 1)
    hf = h.reshape((n_layers, -1) + tuple(h.shape[-3:])) if multi else h.reshape((1, -1) + tuple(h.shape[-3:]))
    if state_v_first:
        h_sv, h_sk = hf.stride(3), hf.stride(4)
    else:
        h_sk, h_sv = hf.stride(3), hf.stride(4)
    h_sl = hf.stride(0) if n_layers > 1 else 0
    _check_inner(dst_q, 2, "checkpoint q")
    q_l = dst_q[:, first]
    quant = dst_scale is not None
    sc_l = dst_scale[:, first] if quant else q_l
    sc_strides = (dst_scale.stride(1), dst_scale.stride(0)) if quant else (0, 0)
    if conv_src is not None:
        if token_ends is None or dst_conv is None:
            raise ValueError("conv_src needs token_ends and dst_conv")
        if conv_src.stride(-1) != 1:
            raise ValueError("conv_src rows must be contiguous")
        if multi and (conv_src.dim() != 3 or conv_src.shape[0] != n_layers):
            raise ValueError("a multi-layer store needs conv_src [n_layers, T, D]")
        conv_d = conv_src.shape[-1]
        conv_n = dst_conv.shape[-1]
        conv_w = conv_n // conv_d
        # host values: check without a device sync
        if not torch.is_tensor(token_ends) and min(int(x) for x in token_ends) < conv_w:
            raise ValueError("a boundary is closer than the conv width to the stream start")
        te = _idx(token_ends, dev)  # device tensors are the caller's responsibility (no sync)
        cd_l = dst_conv[:, first]
        t_sl = conv_src.stride(0) if multi else 0
        conv = (conv_src, t_sl, conv_src.stride(-2), cd_l, dst_conv.stride(1), dst_conv.stride(0))
    else:
        conv_n = conv_d = conv_w = 0
        te = di
        conv = (None, 0, 0, None, 0, 0)
    tiles = H * triton.cdiv(K, BK)
    grid = (tiles + triton.cdiv(conv_n, BC), n, n_layers)
    _store_intermediate_kernel[grid](
        hf,
        h_sl,
        hf.stride(1),
        hf.stride(2),
        h_sv,
        h_sk,
        q_l,
        dst_q.stride(1),
        dst_q.stride(0),
        sc_l,
        *sc_strides,
        *conv,
        ci,
        di,
        te,
        bad,
        conv_n,
        conv_d,
        conv_w,
        H=H,
        V=V,
        K=K,
        VP=_next_pow2(V),
        BK=BK,
        BC=BC,
        QUANT=quant,
        HAS_CONV=conv_src is not None,
        num_warps=num_warps,
    )
    return bad[:n].bool()
