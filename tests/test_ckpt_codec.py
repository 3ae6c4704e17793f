"""The checkpoint codec: round-trip bounds of the references on random and real KDA states,
fp32 bit-exactness, NaN/Inf refusal, the chunk_kda export path, and Triton == reference
(through Triton's interpreter on CPU, and compiled on CUDA when present)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sglang_k3.kernels import ckpt as K
from sglang_k3.kernels.ckpt import reference as R

HAS_CUDA = torch.cuda.is_available()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kda_inputs(B, T, H, D, seed, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    # per-channel log decays: a spread of channel time constants, as a trained KDA gate gives
    gate = F.logsigmoid(torch.randn(B, T, H, D, generator=g) * 2 + torch.linspace(-1, 5, D))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    return [t.to(device) for t in (q, k, v, gate, beta)]


@pytest.fixture(scope="module")
def kda_states():
    """Real KDA recurrent states from fla's naive recurrence, in upstream's [H, V, K] layout."""
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta = kda_inputs(2, 192, 2, 128, seed=1)
    _, S = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)  # [B, H, K, V]
    return S.transpose(-1, -2).contiguous()  # [B, H, V, K]


def active(L, S, H, V, Kd, seed=0, conv=(3, 40)):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(L, S, H, V, Kd, generator=g) * torch.rand(L, S, H, 1, Kd, generator=g).pow(3) * 4
    c = torch.randn((L, S) + conv, generator=g).to(torch.bfloat16) if conv else None
    return t, c


def ckpt_bufs(n, L, H, V, Kd, dtype, conv_numel=120):
    q = torch.zeros(n, L, H, V, Kd, dtype=dtype)
    s = torch.zeros(n, L, H, Kd) if dtype == torch.int8 else None
    c = torch.zeros(n, L, conv_numel, dtype=torch.bfloat16)
    return q, s, c


# ---------------------------------------------------------------- reference round-trip bounds


@pytest.mark.parametrize("seed", [0, 84, 221, 1234])
def test_int8_elementwise_bound_random(seed):
    # seeded: unseeded, this drew whatever the earlier tests left in torch's generator and failed
    # in CI on a draw where fp32 rounding put one element a single ulp of amax past half a step.
    # Seeds 84 and 221 are two such draws (found by sweeping 3,000 seeds: 17 failed the old bound)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 64, 32, generator=g) * torch.rand(3, 4, 1, 32, generator=g) * 10
    q, s = R.quantize_tile(x)
    y = R.dequantize_tile(q, s)
    amax = x.abs().amax(dim=-2, keepdim=True)
    # rounding error at most half a step, plus fp32 rounding in x * (127 / amax) and in q * scale:
    # each is at most an ulp of amax (|x|, |y| <= amax), so 4 ulps covers them with room
    assert ((y - x).abs() <= amax / 254 + 4 * amax * 2.0**-24).all()
    assert q.abs().max() <= 127
    assert rel(y, x) < 0.01


def test_int8_zero_and_tiny_columns():
    x = torch.zeros(2, 16, 8)
    x[0, :, 3] = 1e-35  # below TINY: stored as zero
    x[1, 5, 2] = -2.0
    q, s = R.quantize_tile(x)
    y = R.dequantize_tile(q, s)
    assert torch.isfinite(y).all()
    assert y[1, 5, 2] == -2.0 and (y[0] == 0).all()


def test_int8_and_bf16_bounds_on_real_kda_states(kda_states):
    x = kda_states
    q, s = R.quantize_tile(x)
    e8 = rel(R.dequantize_tile(q, s), x)
    e16 = rel(x.to(torch.bfloat16), x)
    print(f"real KDA states: int8 rel err {e8:.4g}, bf16 rel err {e16:.4g}")
    assert e8 < 0.012
    assert e16 < 2**-8
    # readout error: what a restored state does to the next output q^T S
    qv = F.normalize(torch.randn(x.shape[0], x.shape[1], x.shape[-1]), dim=-1)
    o = torch.einsum("bhvk,bhk->bhv", x, qv)
    o8 = torch.einsum("bhvk,bhk->bhv", R.dequantize_tile(q, s), qv)
    assert rel(o8, o) < 0.02


def test_scale_axis_choice_is_measured(kda_states):
    """The justification in kernels/ckpt/__init__.py: per-(head, k) scales over V beat per-(head, v)
    scales over K on real KDA states; V split in 4 groups lowers the error only modestly."""
    x = kda_states
    per_k = rel(R.dequantize_tile(*R.quantize_tile(x)), x)
    xt = x.transpose(-1, -2)
    per_v = rel(R.dequantize_tile(*R.quantize_tile(xt)).transpose(-1, -2), x)
    B, H, V, Kd = x.shape
    xg = x.reshape(B, H, 4, V // 4, Kd)
    grouped = rel(R.dequantize_tile(*R.quantize_tile(xg)).reshape(x.shape), x)
    print(f"per-k {per_k:.4g}  per-v {per_v:.4g}  per-k V/4 groups {grouped:.4g}")
    assert per_k < per_v
    assert grouped > 0.6 * per_k  # < 1.7x gain for 4x the scale bytes


def test_fp32_copy_bit_exact_and_conv_native():
    t, c = active(3, 6, 2, 16, 32)
    q, _, cc = ckpt_bufs(4, 3, 2, 16, 32, torch.float32)
    bad = K.copy_to_ckpt(t, c, [5, 0, 3], q, cc, [2, 0, 1])
    assert not bad.any()
    y, yc = torch.zeros_like(t), torch.zeros_like(c)
    K.copy_from_ckpt(q, cc, [0, 1, 2], y, yc, [1, 2, 4])
    assert torch.equal(y[:, [1, 2, 4]], t[:, [0, 3, 5]])
    assert torch.equal(yc[:, [1, 2, 4]], c[:, [0, 3, 5]])
    assert (y[:, [0, 3, 5]] == 0).all()  # untouched slots untouched


def test_bf16_ckpt_round_trip():
    t, c = active(2, 3, 2, 16, 32)
    q, _, cc = ckpt_bufs(3, 2, 2, 16, 32, torch.bfloat16)
    assert not K.copy_to_ckpt(t, c, [0, 1, 2], q, cc, [0, 1, 2]).any()
    y, yc = torch.zeros_like(t), torch.zeros_like(c)
    K.copy_from_ckpt(q, cc, [0, 1, 2], y, yc, [0, 1, 2])
    assert ((y - t).abs() <= t.abs() * 2**-8 + 1e-30).all()
    assert torch.equal(yc, c)


def test_int8_scatter_gather_roundtrip_and_conv():
    t, c = active(3, 6, 2, 16, 32, seed=3)
    q, s, cc = ckpt_bufs(4, 3, 2, 16, 32, torch.int8)
    bad = K.quant_scatter(t, c, [1, 4], q, s, cc, [3, 0])
    assert not bad.any()
    y, yc = torch.zeros_like(t), torch.zeros_like(c)
    K.gather_dequant(q, s, cc, [3, 0], y, yc, [0, 5])
    assert rel(y[:, 0], t[:, 1]) < 0.01 and rel(y[:, 5], t[:, 4]) < 0.01
    assert torch.equal(yc[:, 0], c[:, 1]) and torch.equal(yc[:, 5], c[:, 4])
    # without conv
    y2 = torch.zeros_like(t)
    K.gather_dequant(q, s, None, [3], y2, None, [2])
    assert torch.equal(y2[:, 2], y[:, 0])


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_pairs_reported(bad_value):
    t, c = active(2, 5, 2, 8, 16)
    t[1, 3, 0, 2, 5] = bad_value
    c2 = c.clone()
    c2[0, 1, 0, 7] = bad_value
    q, s, cc = ckpt_bufs(4, 2, 2, 8, 16, torch.int8, conv_numel=120)
    bad = K.quant_scatter(t, c2, [0, 3, 1, 2], q, s, cc, [0, 1, 2, 3])
    assert bad.tolist() == [False, True, True, False]
    qf, _, ccf = ckpt_bufs(4, 2, 2, 8, 16, torch.float32)
    assert K.copy_to_ckpt(t, c2, [0, 3, 1], qf, ccf, [0, 1, 2]).tolist() == [False, True, True]


def test_bf16_overflow_is_refused():
    t, c = active(1, 2, 1, 8, 8)
    t[0, 1, 0, 0, 0] = 3.4e38  # finite in fp32, inf in bf16
    q, _, cc = ckpt_bufs(2, 1, 1, 8, 8, torch.bfloat16, conv_numel=120)
    assert K.copy_to_ckpt(t, c, [0, 1], q, cc, [0, 1]).tolist() == [False, True]
    q32, _, cc32 = ckpt_bufs(2, 1, 1, 8, 8, torch.float32, conv_numel=120)
    assert K.copy_to_ckpt(t, c, [0, 1], q32, cc32, [0, 1]).tolist() == [False, False]


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_store_intermediate_matches_store_of_same_state(state_v_first, dtype):
    B, NT, H, D, W, Dc = 2, 3, 2, 16, 3, 20
    h = torch.randn(B, NT, H, D, D).to(torch.bfloat16)
    stream = torch.randn(B * NT * 64, Dc).to(torch.bfloat16)
    q, s, cc = ckpt_bufs(3, 2, H, D, D, dtype, conv_numel=W * Dc)
    bad = K.store_intermediate(
        h, [4, 1], 1, q, s, [2, 0], state_v_first=state_v_first, conv_src=stream, token_ends=[128, 300], dst_conv=cc
    )
    assert not bad.any()
    hf = h.reshape(-1, H, D, D)
    for slot, ci, te in ((2, 4, 128), (0, 1, 300)):
        st = hf[ci] if state_v_first else hf[ci].transpose(-1, -2)  # [H, V, K]
        if dtype == torch.int8:
            q8, s8 = R.quantize_tile(st)
            assert torch.equal(q[slot, 1], q8) and torch.equal(s[slot, 1], s8)
        else:
            assert torch.equal(q[slot, 1], st.to(dtype))  # bf16 -> fp32/bf16 is exact
        assert torch.equal(cc[slot, 1].view(W, Dc), stream[te - W : te])
        assert (q[slot, 0] == 0).all()  # other layers untouched
    h[1, 1, 0, 0, 0] = float("nan")
    bad = K.store_intermediate(h, [4, 1], 0, q, s, [2, 0], state_v_first=state_v_first)
    assert bad.tolist() == [True, False]


def test_intermediate_chunk_index():
    assert K.intermediate_chunk_index([0, 5, 9], 1, 128) == 7
    with pytest.raises(ValueError):
        K.intermediate_chunk_index([0, 5], 1, 100)


# ---------------------------------------------------------------- Triton == reference

_INTERP_SCRIPT = textwrap.dedent(r"""
    import torch
    from sglang_k3.kernels.ckpt import triton_kernels as tk, reference as ref
    torch.manual_seed(0)
    L, S, H, V, Kd, W, D = 3, 6, 2, 16, 32, 3, 40
    act = torch.randn(L, S, H, V, Kd) * torch.rand(1, 1, 1, 1, Kd) * 3
    conv = torch.randn(L, S, W, D).bfloat16()
    act[1, 4, 1, 3, 5] = float('nan')
    def mk():
        return (torch.zeros(5, L, H, V, Kd, dtype=torch.int8), torch.zeros(5, L, H, Kd),
                torch.zeros(5, L, W * D, dtype=torch.bfloat16))
    a, b = mk(), mk()
    src, dst = [0, 4, 2], [3, 1, 0]
    b1 = ref.quant_scatter_ref(act, conv, src, *a, dst)
    b2 = tk.quant_scatter(act, conv, src, *b, dst, BK=8, BC=64)
    assert b1.tolist() == b2.tolist() == [False, True, False]
    for x, y in zip(a, b):
        assert torch.equal(x[[3, 0]], y[[3, 0]])
    ya, yb = torch.zeros_like(act), torch.zeros_like(act)
    ca, cb = torch.zeros_like(conv), torch.zeros_like(conv)
    ref.gather_dequant_ref(a[0], a[1], a[2], [3, 0], ya, ca, [5, 1])
    tk.gather_dequant(a[0], a[1], a[2], [3, 0], yb, cb, [5, 1], BK=8, BC=64)
    assert torch.equal(ya, yb) and torch.equal(ca, cb)
    ct, cc = torch.zeros(5, L, H, V, Kd), torch.zeros(5, L, W * D, dtype=torch.bfloat16)
    ct2, cc2 = ct.clone(), cc.clone()
    assert ref.copy_to_ckpt_ref(act, conv, src, ct, cc, dst).tolist() == \
        tk.copy_to_ckpt(act, conv, src, ct2, cc2, dst, BT=256, BC=64).tolist()
    assert torch.equal(ct[[3, 0]], ct2[[3, 0]]) and torch.equal(cc, cc2)
    ya, yb = torch.zeros_like(act), torch.zeros_like(act)
    ref.copy_from_ckpt_ref(ct, None, [3, 0], ya, None, [2, 1])
    tk.copy_from_ckpt(ct, None, [3, 0], yb, None, [2, 1], BT=256)
    assert torch.equal(ya, yb)
    for vf in (False, True):
        h = torch.randn((2, 4, H, V, Kd) if vf else (2, 4, H, Kd, V)).bfloat16()
        stream = torch.randn(512, D).bfloat16()
        a, b = mk(), mk()
        r1 = ref.store_intermediate_ref(h, [1, 6], 1, a[0], a[1], [2, 4], state_v_first=vf,
                                        conv_src=stream, token_ends=[64, 320], dst_conv=a[2])
        r2 = tk.store_intermediate(h, [1, 6], 1, b[0], b[1], [2, 4], state_v_first=vf,
                                   conv_src=stream, token_ends=[64, 320], dst_conv=b[2], BK=8, BC=64)
        assert r1.tolist() == r2.tolist()
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        # all layers in one launch: h and the token stream stacked on a leading layer axis
        hs = torch.randn((L, 8, H, V, Kd) if vf else (L, 8, H, Kd, V)).bfloat16()
        hs[2, 5, 1, 0, 0] = float('inf')
        streams = torch.randn(L, 512, D).bfloat16()
        for dt in (torch.int8, torch.float32):
            a, b = mk(), mk()
            if dt == torch.float32:
                a = (a[0].float(), None, a[2]); b = (b[0].float(), None, b[2])
            r1 = ref.store_intermediate_ref(hs, [5, 1], range(L), a[0], a[1], [2, 4], state_v_first=vf,
                                            conv_src=streams, token_ends=[64, 320], dst_conv=a[2])
            r2 = tk.store_intermediate(hs, [5, 1], range(L), b[0], b[1], [2, 4], state_v_first=vf,
                                       conv_src=streams, token_ends=[64, 320], dst_conv=b[2], BK=8, BC=64)
            assert r1.tolist() == r2.tolist() == [True, False]
            for x, y in zip(a, b):
                if x is not None:
                    assert torch.equal(x[4], y[4])
    print("INTERP_OK")
""")


def test_triton_kernels_equal_reference_in_interpreter():
    """Runs the Triton kernels through Triton's CPU interpreter (no GPU needed). The fp32->bf16
    cast is not compared here: the interpreter truncates where the GPU rounds to nearest even;
    the CUDA test below covers it."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "INTERP_OK" in r.stdout, r.stderr[-4000:]


cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dims", [(4, 9, 4, 128, 128, (3, 384)), (2, 5, 3, 64, 32, (3, 40)), (2, 4, 2, 16, 16, None)])
def test_cuda_kernels_equal_reference(dims):
    L, S, H, V, Kd, conv = dims
    t, c = active(L, S, H, V, Kd, seed=7, conv=conv)
    t[1, 2, 0, 1, 1] = float("nan")
    t, c = t.cuda(), (c.cuda() if c is not None else None)
    numel = conv[0] * conv[1] if conv else 1
    src, dst = [2, 0, S - 1, 3], [1, 4, 0, 2]
    for dtype in (torch.int8, torch.bfloat16, torch.float32):
        bufs = [x.cuda() if x is not None else None for x in ckpt_bufs(5, L, H, V, Kd, dtype, numel)]
        if c is None:
            bufs[2] = None
        bufs_ref = [x.clone() if x is not None else None for x in bufs]
        if dtype == torch.int8:
            b1 = K.quant_scatter(t, c, src, *bufs, dst, use_triton=True)
            b2 = K.quant_scatter(t, c, src, *bufs_ref, dst, use_triton=False)
        else:
            b1 = K.copy_to_ckpt(t, c, src, bufs[0], bufs[2], dst, use_triton=True)
            b2 = K.copy_to_ckpt(t, c, src, bufs_ref[0], bufs_ref[2], dst, use_triton=False)
        assert b1.tolist() == b2.tolist() == [True, False, False, False]
        good = [4, 0, 2]
        for x, y in zip(bufs, bufs_ref):
            if x is not None:
                assert torch.equal(x[good], y[good]), dtype
        y1, y2 = torch.zeros_like(t), torch.zeros_like(t)
        c1 = torch.zeros_like(c) if c is not None else None
        c2 = torch.zeros_like(c) if c is not None else None
        if dtype == torch.int8:
            K.gather_dequant(bufs[0], bufs[1], bufs[2], good, y1, c1, [1, 2, 3], use_triton=True)
            K.gather_dequant(bufs[0], bufs[1], bufs[2], good, y2, c2, [1, 2, 3], use_triton=False)
        else:
            K.copy_from_ckpt(bufs[0], bufs[2], good, y1, c1, [1, 2, 3], use_triton=True)
            K.copy_from_ckpt(bufs[0], bufs[2], good, y2, c2, [1, 2, 3], use_triton=False)
        assert torch.equal(y1, y2)
        if c is not None:
            assert torch.equal(c1, c2)
        if dtype == torch.float32:
            assert torch.equal(y1[:, [1, 2, 3]], t[:, [0, S - 1, 3]])


@cuda
@pytest.mark.parametrize("state_v_first", [False, True])
def test_cuda_store_intermediate_equals_reference(state_v_first):
    H, D, W, Dc = 4, 128, 3, 96
    h = torch.randn(1, 10, H, D, D, device="cuda").to(torch.bfloat16)
    stream = torch.randn(640, Dc, device="cuda").to(torch.bfloat16)
    for dtype in (torch.int8, torch.bfloat16, torch.float32):
        a = [x.cuda() for x in ckpt_bufs(4, 3, H, D, D, dtype, W * Dc) if x is not None]
        if dtype != torch.int8:
            a.insert(1, None)
        b = [x.clone() if x is not None else None for x in a]
        kw = dict(state_v_first=state_v_first, conv_src=stream, token_ends=[192, 600, 64])
        r1 = K.store_intermediate(h, [3, 9, 1], 2, a[0], a[1], [1, 3, 0], dst_conv=a[2], use_triton=True, **kw)
        r2 = K.store_intermediate(h, [3, 9, 1], 2, b[0], b[1], [1, 3, 0], dst_conv=b[2], use_triton=False, **kw)
        assert r1.tolist() == r2.tolist() == [False] * 3
        for x, y in zip(a, b):
            if x is not None:
                assert torch.equal(x, y)
        # all three layers in one launch from stacked rows == the reference, layer by layer
        hs = torch.randn(3, 5, H, D, D, device="cuda").to(torch.bfloat16)
        streams = torch.randn(3, 5 * W, Dc, device="cuda").to(torch.bfloat16)
        a = [x.zero_() if x is not None else None for x in a]
        b = [x.clone() if x is not None else None for x in a]
        kw = dict(state_v_first=state_v_first, conv_src=streams, token_ends=[W * 2, W * 5])
        r1 = K.store_intermediate(hs, [1, 4], range(3), a[0], a[1], [2, 0], dst_conv=a[2], use_triton=True, **kw)
        r2 = K.store_intermediate(hs, [1, 4], range(3), b[0], b[1], [2, 0], dst_conv=b[2], use_triton=False, **kw)
        assert r1.tolist() == r2.tolist() == [False] * 2
        for x, y in zip(a, b):
            if x is not None:
                assert torch.equal(x, y)


@cuda
def test_cuda_chunk_kda_intermediate_contract():
    """h[i] from chunk_kda(return_intermediate_states=True) is the state after 64*i tokens: it
    equals (to bf16) the final state of a run over the first 64*i tokens; h[0] is the initial state."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    q, k, v, g, beta = kda_inputs(1, 512, 4, 128, seed=5, device="cuda")
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    with torch.inference_mode():
        _, _, h = fla_kda.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
        assert h.shape == (1, 8, 4, 128, 128) and h.dtype == torch.bfloat16
        assert (h[0, 0] == 0).all()
        for i in (1, 3, 7):
            _, st = fla_kda.chunk_kda(
                q[:, : 64 * i],
                k[:, : 64 * i],
                v[:, : 64 * i],
                g[:, : 64 * i],
                beta[:, : 64 * i],
                output_final_state=True,
            )
            assert rel(h[0, i], st[0]) < 1e-2
