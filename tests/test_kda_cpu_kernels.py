"""The pure-torch KDA kernels (sglang_k3.kernels.kda) against fla's naive references and direct
formulas. Random inputs come from seeds drawn by hypothesis (printed on failure) or fixed seeds.

Tolerance: fp32 throughout; outputs are compared with atol/rtol 2e-4 after scaling by the
reference magnitude (the chunked and recurrent forms sum in different orders).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_k3.kernels.kda.chunk_torch import CHUNK_SIZE, chunk_kda_torch, chunk_layout
from sglang_k3.kernels.kda.conv1d_torch import (
    causal_conv1d_update_torch,
    causal_conv1d_varlen_torch,
)
from sglang_k3.kernels.kda.gate_torch import kda_gate, l2norm
from sglang_k3.kernels.kda.gated_rmsnorm_torch import rms_norm_gated_torch
from sglang_k3.kernels.kda.pool_ops import (
    kda_chunk_extend_pool,
    kda_packed_decode_pool,
    kda_recurrent_decode_pool,
)
from sglang_k3.kernels.kda.recurrent_torch import fused_recurrent_kda_torch

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def assert_close(actual, expected, tol=2e-4, what=""):
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if actual.numel() == 0:
        return
    scale = max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} (scale {scale:.2e})"


def make_inputs(gen, T, H, K, V, HV=None, decay=2.0, B=1):
    HV = HV or H
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.rand(B, T, HV, K, generator=gen) * decay
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


# ---------------------------------------------------------------- chunked prefill


@SETTINGS
@given(
    seed=seeds,
    T=st.integers(1, 200),
    H=st.integers(1, 3),
    G=st.sampled_from([1, 2]),
    K=st.sampled_from([16, 32, 64]),
    V=st.sampled_from([8, 16, 32]),
    decay=st.sampled_from([0.05, 1.0, 5.0]),
    with_init=st.booleans(),
)
def test_chunk_matches_naive_recurrent(seed, T, H, G, K, V, decay, with_init):
    gen = torch.Generator().manual_seed(seed)
    B = 2
    q, k, v, g, beta = make_inputs(gen, T, H, K, V, HV=H * G, decay=decay, B=B)
    h0 = torch.randn(B, H * G, K, V, generator=gen) if with_init else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="final state")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_matches_naive_chunk(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = make_inputs(gen, 192, 2, 32, 16, B=2)
    h0 = torch.randn(2, 2, 32, 16, generator=gen)
    o_ref, s_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="final state")


def test_chunk_strong_decay_is_finite_and_exact():
    # Per-token log decays down to -300: a factorization through exp(+g) would overflow fp32.
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta = make_inputs(gen, 150, 2, 32, 16, decay=300.0)
    h0 = torch.randn(1, 2, 32, 16, generator=gen)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="final state")


def _varlen_case(gen, lens, H, K, V, decay=1.0):
    T = sum(lens)
    q, k, v, g, beta = make_inputs(gen, T, H, K, V, decay=decay)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    h0 = torch.randn(len(lens), H, K, V, generator=gen)
    return q, k, v, g, beta, cu, h0


@SETTINGS
@given(
    seed=seeds,
    lens=st.lists(st.integers(0, 200), min_size=1, max_size=5),
    H=st.integers(1, 3),
    K=st.sampled_from([16, 32]),
    V=st.sampled_from([8, 16]),
)
def test_chunk_varlen_with_initial_states_and_checkpoints(seed, lens, H, K, V):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, cu, h0 = _varlen_case(gen, lens, H, K, V)
    o, s, h = chunk_kda_torch(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        return_intermediate_states=True,
    )
    _, _, offsets, _ = chunk_layout(cu)
    assert h.shape == (1, sum(math.ceil(n / CHUNK_SIZE) for n in lens), H, K, V)
    for n, L in enumerate(lens):
        a, b = int(cu[n]), int(cu[n + 1])
        sl = lambda x, a=a, b=b: x[:, a:b]
        o_ref, s_ref = naive_recurrent_kda(
            sl(q),
            sl(k),
            sl(v),
            sl(g),
            sl(beta),
            initial_state=h0[n : n + 1],
            output_final_state=True,
        )
        assert_close(o[:, a:b], o_ref, what=f"o seq {n}")
        assert_close(s[n : n + 1], s_ref, what=f"final state seq {n}")
        # h[offsets[n] + i] is the state after 64 * i tokens of this sequence: run the naive
        # recurrence chunk by chunk, chaining its final state.
        ref = h0[n : n + 1]
        for i in range(math.ceil(L / CHUNK_SIZE)):
            assert_close(h[0, int(offsets[n]) + i], ref[0], tol=2e-5, what=f"h seq {n} chunk {i}")
            c0, c1 = a + CHUNK_SIZE * i, min(a + CHUNK_SIZE * (i + 1), b)
            _, ref = naive_recurrent_kda(
                q[:, c0:c1],
                k[:, c0:c1],
                v[:, c0:c1],
                g[:, c0:c1],
                beta[:, c0:c1],
                initial_state=ref,
                output_final_state=True,
            )


def test_chunk_intermediate_states_v_first_layout():
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = make_inputs(gen, 130, 2, 16, 8)
    h0 = torch.randn(1, 2, 16, 8, generator=gen)
    _, s_kv, h_kv = chunk_kda_torch(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, return_intermediate_states=True
    )
    _, s_vk, h_vk = chunk_kda_torch(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0.transpose(-1, -2),
        output_final_state=True,
        return_intermediate_states=True,
        state_v_first=True,
    )
    assert h_kv.shape == (1, 3, 2, 16, 8) and h_vk.shape == (1, 3, 2, 8, 16)
    assert_close(h_vk, h_kv.transpose(-1, -2), tol=1e-6, what="h V-first")
    assert_close(s_vk, s_kv.transpose(-1, -2), tol=1e-6, what="final V-first")


# ---------------------------------------------------------------- recurrent decode


@SETTINGS
@given(seed=seeds, lens=st.lists(st.integers(1, 6), min_size=1, max_size=6), G=st.sampled_from([1, 2]))
def test_recurrent_varlen_matches_naive(seed, lens, G):
    gen = torch.Generator().manual_seed(seed)
    H, K, V = 2, 16, 8
    T = sum(lens)
    q, k, v, g, beta = make_inputs(gen, T, H, K, V, HV=H * G)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    h0 = torch.randn(len(lens), H * G, K, V, generator=gen)
    o, s = fused_recurrent_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lens)):
        a, b = int(cu[n]), int(cu[n + 1])
        o_ref, s_ref = naive_recurrent_kda(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            g[:, a:b],
            beta[:, a:b],
            initial_state=h0[n : n + 1],
            output_final_state=True,
        )
        assert_close(o[:, a:b], o_ref, what=f"o seq {n}")
        assert_close(s[n : n + 1], s_ref, what=f"state seq {n}")


def test_recurrent_l2norm_and_scale():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = make_inputs(gen, 9, 2, 16, 8)
    k = k * 3.0
    o, s = fused_recurrent_kda_torch(q, k, v, g, beta, scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o_ref, s_ref = naive_recurrent_kda(qn, kn, v, g, beta, scale=0.3, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")
    assert_close(l2norm(q), qn, tol=1e-6, what="l2norm")


# ---------------------------------------------------------------- gates


def test_kda_gate_formulas():
    gen = torch.Generator().manual_seed(3)
    H, K = 3, 8
    x = torch.randn(4, H, K, generator=gen) * 15  # crosses the softplus threshold (20)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    z = x + dt_bias.view(H, K)
    sp = torch.where(z > 20, z, torch.log(1 + torch.exp(torch.clamp(z, max=20))))
    ref = -torch.exp(A_log).view(H, 1) * sp
    assert_close(kda_gate(x, A_log.view(1, 1, H, 1), dt_bias), ref, tol=1e-6, what="softplus gate")
    ref_safe = -5.0 * torch.sigmoid(torch.exp(A_log).view(H, 1) * z)
    got_safe = kda_gate(x, A_log, dt_bias, lower_bound=-5.0)
    assert_close(got_safe, ref_safe, tol=1e-6, what="safe gate")
    assert (got_safe >= -5.0).all() and (got_safe <= 0).all()


# ---------------------------------------------------------------- conv1d


def direct_conv(hist, xs, weight, bias, silu=True):
    """Per-token direct causal convolution: ``hist`` [dim, W-1] history, ``xs`` [dim, L]."""
    W = weight.shape[1]
    full = torch.cat([hist, xs], 1)
    out = []
    for t in range(xs.shape[1]):
        acc = (full[:, t : t + W] * weight).sum(1)
        if bias is not None:
            acc = acc + bias
        out.append(F.silu(acc) if silu else acc)
    return torch.stack(out, 1), full[:, -(W - 1) :]


@SETTINGS
@given(
    seed=seeds,
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    n_decode=st.integers(0, 4),
    W=st.sampled_from([2, 3, 4]),
    use_bias=st.booleans(),
    init_flags=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_conv1d_prefill_then_update_equals_direct_convolution(seed, lens, n_decode, W, use_bias, init_flags):
    gen = torch.Generator().manual_seed(seed)
    dim, N = 12, len(lens)
    slots_total = N + 3
    weight = torch.randn(dim, W, generator=gen)
    bias = torch.randn(dim, generator=gen) if use_bias else None
    # KDA pool layout [slots, W-1, dim]; the kernels see its [slots, dim, W-1] transpose.
    pool = torch.randn(slots_total, W - 1, dim, generator=gen)
    pool0 = pool.clone()
    slots = torch.randperm(slots_total, generator=gen)[:N].to(torch.int32)
    has_init = torch.tensor(init_flags[:N])
    T = sum(lens)
    x = torch.randn(T, dim, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = causal_conv1d_varlen_torch(
        x.transpose(0, 1),
        weight,
        bias,
        pool.transpose(-1, -2),
        cu,
        cache_indices=slots,
        has_initial_state=has_init,
        activation="silu",
    ).transpose(0, 1)
    hists = []
    for n in range(N):
        h = pool0[slots[n]].transpose(0, 1) if has_init[n] else torch.zeros(dim, W - 1)
        a, b = int(cu[n]), int(cu[n + 1])
        ref, new_hist = direct_conv(h, x[a:b].transpose(0, 1), weight, bias)
        assert_close(out[a:b], ref.transpose(0, 1), tol=1e-5, what=f"prefill seq {n}")
        assert_close(pool[slots[n]], new_hist.transpose(0, 1), tol=0, what=f"state seq {n}")
        hists.append(new_hist)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], pool0[untouched])
    for _ in range(n_decode):
        xd = torch.randn(N, dim, generator=gen)
        yd = causal_conv1d_update_torch(
            xd, pool.transpose(-1, -2), weight, bias, activation="silu", conv_state_indices=slots
        )
        for n in range(N):
            ref, hists[n] = direct_conv(hists[n], xd[n : n + 1].T, weight, bias)
            assert_close(yd[n], ref[:, 0], tol=1e-5, what=f"decode seq {n}")
            assert_close(pool[slots[n]], hists[n].transpose(0, 1), tol=0, what="decode state")


def test_conv1d_pad_slot_leaves_cache_alone():
    gen = torch.Generator().manual_seed(9)
    dim, W = 6, 4
    weight = torch.randn(dim, W, generator=gen)
    pool = torch.randn(3, W - 1, dim, generator=gen)
    pool0 = pool.clone()
    x = torch.randn(2, dim, generator=gen)
    y = causal_conv1d_update_torch(
        x,
        pool.transpose(-1, -2),
        weight,
        None,
        activation=None,
        conv_state_indices=torch.tensor([-1, 2], dtype=torch.int32),
    )
    assert torch.equal(pool[:2], pool0[:2]) and not torch.equal(pool[2], pool0[2])
    ref, _ = direct_conv(pool0[2].T, x[1:2].T, weight, None, silu=False)
    assert_close(y[1], ref[:, 0], tol=1e-5)


# ---------------------------------------------------------------- gated rmsnorm


@pytest.mark.parametrize("activation", ["sigmoid", "swish"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gated_rmsnorm_formula(activation, with_residual):
    gen = torch.Generator().manual_seed(13)
    D, eps = 32, 1e-5
    x = torch.randn(1, 5, 3, D, generator=gen)
    g = torch.randn(5, 3, D, generator=gen)  # kimi_linear passes g without the leading 1
    w = torch.randn(D, generator=gen)
    res = torch.randn(1, 5, 3, D, generator=gen) if with_residual else None
    out = rms_norm_gated_torch(x, g, w, None, activation, residual=res, prenorm=with_residual, eps=eps)
    xr = x + res if with_residual else x
    y = xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w
    gate = torch.sigmoid(g) if activation == "sigmoid" else g * torch.sigmoid(g)
    ref = y * gate.view_as(y)
    if with_residual:
        out, res_out = out
        assert_close(res_out, xr, tol=1e-6, what="residual out")
    assert_close(out, ref, tol=1e-5, what="y")


# ---------------------------------------------------------------- SGLang-contract pool ops


def test_pool_extend_then_decode_equals_naive_over_whole_sequence():
    """Prefill a varlen batch into slots of a [slots, H, V, K] pool, then decode token by token
    (plain and packed decode): outputs and states equal one naive recurrence over each sequence."""
    gen = torch.Generator().manual_seed(21)
    H, K, V = 2, 16, 8
    lens, n_dec = [70, 5, 128], 3
    N = len(lens)
    A_log = torch.randn(H, generator=gen).view(1, 1, H, 1)
    dt_bias = torch.randn(H * K, generator=gen)
    pool = torch.randn(6, H, V, K, generator=gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool[slots.long()] = 0.0  # fresh requests: the pool hands out zeroed slots
    pool_before = pool.clone()
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    a = torch.randn(1, T, H, K, generator=gen)
    b = torch.randn(1, T, H, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o, h = kda_chunk_extend_pool(
        q,
        k,
        v,
        a,
        b,
        ssm_states=pool,
        cache_indices=slots,
        query_start_loc=cu,
        A_log=A_log,
        dt_bias=dt_bias,
        beta_is_raw=True,
        return_intermediate_states=True,
    )
    assert h.shape == (1, 2 + 1 + 2, H, V, K)
    for s in (1, 3, 5):
        assert torch.equal(pool[s], pool_before[s])
    # decode steps
    qd = torch.randn(n_dec, N, H, K, generator=gen)
    kd = torch.randn(n_dec, N, H, K, generator=gen)
    vd = torch.randn(n_dec, N, H, V, generator=gen)
    ad = torch.randn(n_dec, N, H * K, generator=gen)
    bd = torch.randn(n_dec, N, H, generator=gen)
    outs = []
    for t in range(n_dec):
        if t % 2 == 0:
            od = kda_recurrent_decode_pool(
                qd[t][None],
                kd[t][None],
                vd[t][None],
                ad[t],
                bd[t][None],
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=pool,
                cache_indices=slots,
                query_start_loc=torch.arange(N + 1, dtype=torch.int32),
            )
        else:
            mixed = torch.cat([qd[t].flatten(1), kd[t].flatten(1), vd[t].flatten(1)], -1)
            od = kda_packed_decode_pool(
                mixed,
                ad[t],
                bd[t][None],
                A_log=A_log,
                dt_bias=dt_bias,
                scale=K**-0.5,
                ssm_states=pool,
                cache_indices=slots,
                num_v_heads=H,
                head_v_dim=V,
            )
        assert od.shape == (1, N, H, V)
        outs.append(od[0])
    for n in range(N):
        s0, s1 = int(cu[n]), int(cu[n + 1])
        qq = torch.cat([q[0, s0:s1], qd[:, n]])[None]
        kk = torch.cat([k[0, s0:s1], kd[:, n]])[None]
        vv = torch.cat([v[0, s0:s1], vd[:, n]])[None]
        aa = torch.cat([a[0, s0:s1], ad[:, n].view(n_dec, H, K)])[None]
        bb = torch.cat([b[0, s0:s1], bd[:, n]])[None]
        gg = -torch.exp(A_log.view(H, 1)) * F.softplus(aa + dt_bias.view(H, K))
        qn = qq / torch.sqrt((qq * qq).sum(-1, keepdim=True) + 1e-6)
        kn = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
        o_ref, s_ref = naive_recurrent_kda(qn, kn, vv, gg, torch.sigmoid(bb), output_final_state=True)
        L = s1 - s0
        assert_close(o[0, s0:s1], o_ref[0, :L], what=f"extend o seq {n}")
        for t in range(n_dec):
            assert_close(outs[t][n], o_ref[0, L + t], what=f"decode o seq {n} step {t}")
        # pool layout is [slots, H, V, K]: the transpose of fla's [H, K, V]
        assert_close(pool[slots[n]], s_ref[0].transpose(-1, -2), what=f"state seq {n}")


def test_pool_extend_pad_slot_and_track_state():
    gen = torch.Generator().manual_seed(23)
    H, K, V = 1, 16, 8
    lens = [130, 40]
    T = sum(lens)
    pool = torch.randn(3, H, V, K, generator=gen)
    pool0 = pool.clone()
    q, k, v, g, beta = make_inputs(gen, T, H, K, V)
    cu = torch.tensor([0, 130, 170], dtype=torch.int32)
    track = torch.full((2, H, V, K), 7.0)
    o, h = kda_chunk_extend_pool(
        q,
        k,
        v,
        g,
        beta,
        ssm_states=pool,
        cache_indices=torch.tensor([1, -1]),
        query_start_loc=cu,
        use_qk_l2norm_in_kernel=False,
        return_intermediate_states=True,
        track_state=track,
        track_chunk_idx=torch.tensor([2, 5]),
    )
    assert torch.equal(pool[[0, 2]], pool0[[0, 2]])  # padded row wrote nothing
    _, s_ref = naive_recurrent_kda(
        q[:, :128],
        k[:, :128],
        v[:, :128],
        g[:, :128],
        beta[:, :128],
        initial_state=pool0[1].transpose(-1, -2)[None],
        output_final_state=True,
    )
    assert_close(h[0, 2], s_ref[0].transpose(-1, -2), what="h after 128 tokens")
    assert torch.equal(track[0], h[0, 2])
    assert (track[1] == 7.0).all()  # chunk index 5 is past sequence 1's single chunk
    # padded row: computed from a zero state
    o_ref, _ = naive_recurrent_kda(q[:, 130:], k[:, 130:], v[:, 130:], g[:, 130:], beta[:, 130:])
    assert_close(o[:, 130:], o_ref, what="padded-row output")


def test_conv1d_varlen_zero_tokens_is_a_no_op():
    """A zero-length extend (e.g. a request that slipped through with no tokens) must not crash
    the scheduler and must leave every conv state as it was."""
    from sglang_k3.kernels.kda.conv1d_torch import causal_conv1d_varlen_torch

    dim, W = 8, 4
    states = torch.randn(3, dim, W - 1)
    before = states.clone()
    out = causal_conv1d_varlen_torch(
        torch.zeros(dim, 0),
        torch.randn(dim, W),
        None,
        states,
        torch.tensor([0, 0], dtype=torch.int32),
        cache_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([True]),
    )
    assert out.shape == (dim, 0)
    assert torch.equal(states, before)
