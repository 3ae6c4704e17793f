"""CheckpointPool: lifecycle (alloc, store, free), read-only sealing, COW restore, fp32 bit-exactness,
int8 accuracy on a real KDA continuation, NaN/Inf refusal, chunk_kda-style export per layer,
memory accounting, and upstream MambaPool tensors as the active side."""

import pytest
import torch
import torch.nn.functional as F

from sglang_k3.state.checkpoint_pool import CheckpointError, CheckpointPool

HAS_CUDA = torch.cuda.is_available()


def make_active(L=3, S=6, H=2, V=16, Kd=16, conv=(3, 48), seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(L, S, H, V, Kd, generator=g) * torch.rand(L, S, H, 1, Kd, generator=g) * 2
    c = torch.randn((L, S) + conv, generator=g).to(torch.bfloat16)
    return t.to(device), c.to(device)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- lifecycle


def test_alloc_free_and_exhaustion():
    t, c = make_active()
    pool = CheckpointPool.from_active(t, c, num_slots=3, dtype="int8")
    a = pool.alloc(2)
    assert len(set(a)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    assert pool.store([0, 1], a).all_ok
    pool.restore([a[0]], [5])  # stored: readable
    assert pool.decref([a[0]]) == [a[0]]
    assert pool.available_size() == 2
    with pytest.raises(CheckpointError):
        pool.restore([a[0]], [5])  # freed
    with pytest.raises(CheckpointError):
        pool.decref([a[0]])  # double free
    b = pool.alloc(2)
    assert a[0] in b  # reused
    with pytest.raises(CheckpointError):
        pool.restore([a[0]], [5])  # a reused slot is blank until stored again


def test_sealed_is_read_only_and_unsealed_not_restorable():
    t, c = make_active()
    pool = CheckpointPool.from_active(t, c, num_slots=2, dtype="fp32")
    (s,) = pool.alloc(1)
    with pytest.raises(CheckpointError):
        pool.restore([s], [0])  # never stored
    pool.store([1], [s])
    before = pool.q[s].clone()
    with pytest.raises(CheckpointError):
        pool.store([2], [s])  # read-only once stored
    assert torch.equal(pool.q[s], before)
    with pytest.raises(CheckpointError):
        (s2,) = pool.alloc(1)
        pool.store([1, 2], [s2, s2])  # duplicate targets


def test_fp32_round_trip_bit_exact_and_cow():
    t, c = make_active(seed=1)
    orig_t, orig_c = t.clone(), c.clone()
    pool = CheckpointPool.from_active(t, c, num_slots=4, dtype="fp32")
    slots = pool.alloc(2)
    assert pool.store([4, 1], slots).all_ok
    # restore into two private slots, then mutate them: the checkpoint must not change
    pool.restore([slots[0], slots[0], slots[1]], [0, 2, 3])
    assert torch.equal(t[:, 0], orig_t[:, 4]) and torch.equal(t[:, 2], orig_t[:, 4])
    assert torch.equal(t[:, 3], orig_t[:, 1])
    assert torch.equal(c[:, 0], orig_c[:, 4]) and torch.equal(c[:, 3], orig_c[:, 1])
    t[:, 0] += 1.0
    c[:, 0] = 0
    pool.restore([slots[0]], [5])
    assert torch.equal(t[:, 5], orig_t[:, 4]) and torch.equal(c[:, 5], orig_c[:, 4])
    assert torch.equal(t[:, 2], orig_t[:, 4])  # the other restored copy is private too


def test_bf16_and_int8_round_trip_bounds():
    t, c = make_active(seed=2)
    orig = t.clone()
    for dtype, bound in (("bf16", 2**-8), ("int8", 0.01)):
        pool = CheckpointPool.from_active(t, c, num_slots=2, dtype=dtype)
        s = pool.alloc(1)
        pool.store([3], s)
        pool.restore(s, [0])
        assert rel(t[:, 0], orig[:, 3]) < bound, dtype
        assert torch.equal(c[:, 0], c[:, 3])
        assert t.dtype == torch.float32  # the active side stays full precision


def test_nan_inf_refused_and_slot_released():
    t, c = make_active(seed=3)
    t[2, 1, 0, 0, 0] = float("nan")
    c[0, 4, 1, 2] = float("inf")
    for dtype in ("int8", "bf16", "fp32"):
        pool = CheckpointPool.from_active(t, c, num_slots=4, dtype=dtype)
        slots = pool.alloc(3)
        res = pool.store([0, 1, 4], slots)
        assert res.accepted == [True, False, False], dtype
        assert res.rejected_slots == slots[1:]
        assert pool.available_size() == 3  # the refused slots went back
        pool.restore([slots[0]], [2])  # the accepted one is stored and readable
        with pytest.raises(CheckpointError):
            pool.restore([slots[1]], [2])


def test_memory_per_slot():
    kw = dict(num_layers=20, num_heads=32, head_v_dim=128, head_k_dim=128, conv_numel=3 * 12288)
    i8 = CheckpointPool.estimate_bytes_per_slot(**kw, dtype="int8")
    assert i8 == 20 * 32 * 128 * 128 + 20 * 32 * 128 * 4 + 20 * 3 * 12288 * 2
    assert CheckpointPool.estimate_bytes_per_slot(**kw, dtype="fp32") == 20 * 32 * 128 * 128 * 4 + 20 * 3 * 12288 * 2
    t, c = make_active()
    for d in ("int8", "bf16", "fp32"):
        p = CheckpointPool.from_active(t, c, num_slots=3, dtype=d)
        est = CheckpointPool.estimate_bytes_per_slot(
            num_layers=3, num_heads=2, head_v_dim=16, head_k_dim=16, conv_numel=144, dtype=d
        )
        real = sum(x[0].numel() * x.element_size() for x in (p.q, p.scale, p.conv) if x is not None)
        assert p.bytes_per_slot == est == real


def test_store_from_intermediate_seals_after_all_layers():
    L, H, D, W, Dc = 3, 2, 16, 3, 16
    t, c = make_active(L=L, H=H, V=D, Kd=D, conv=(W, Dc))
    pool = CheckpointPool.from_active(t, c, num_slots=3, dtype="int8")
    slots = pool.alloc(2)
    hs, streams = [], []
    for layer in range(L):
        h = torch.randn(1, 6, H, D, D).to(torch.bfloat16)  # fla [B, NT, HV, K, V]
        stream = torch.randn(6 * 64, Dc).to(torch.bfloat16)
        with pytest.raises(CheckpointError):
            pool.restore(slots[:1], [0])  # not every layer stored yet: not restorable
        res = pool.store_from_intermediate(layer, h, [2, 5], slots, conv_src=stream, token_ends=[128, 320])
        assert res.all_ok
        with pytest.raises(CheckpointError):
            pool.store_from_intermediate(layer, h, [2, 5], slots, conv_src=stream, token_ends=[128, 320])
        hs.append(h)
        streams.append(stream)
    pool.restore(slots, [0, 1])  # every layer stored: restorable
    for layer in range(L):
        # what the restore gave back: the bf16 state (int8 round trip) and the conv window
        want = hs[layer][0, 2].float().transpose(-1, -2)
        assert rel(t[layer, 0], want) < 0.01
        assert torch.equal(c[layer, 0], streams[layer][128 - W : 128])


def test_store_from_intermediate_rejects_nonfinite_layer():
    t, c = make_active(L=2, H=2, V=16, Kd=16, conv=(3, 16))
    pool = CheckpointPool.from_active(t, c, num_slots=2, dtype="bf16")
    slots = pool.alloc(2)
    h = torch.randn(1, 4, 2, 16, 16).to(torch.bfloat16)
    h[0, 3, 1, 0, 0] = float("inf")
    res = pool.store_from_intermediate(
        0, h, [1, 3], slots, conv_src=torch.randn(256, 16).bfloat16(), token_ends=[64, 192]
    )
    assert res.accepted == [True, False]
    assert pool.available_size() == 1  # the refused slot went back


def test_int8_restore_continues_in_full_precision_on_real_kda():
    """Store a real KDA state as int8 and as fp32, restore each, continue the recurrence in fp32:
    the fp32 path equals the uninterrupted run exactly; the int8 path drifts by a bounded amount."""
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, H, D = 1, 160, 2, 64
    gen = torch.Generator().manual_seed(11)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen) * 2 + torch.linspace(-1, 5, D))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    cut = 96
    _, S = naive_recurrent_kda(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], output_final_state=True)
    o_ref, _ = naive_recurrent_kda(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=S)
    temporal = torch.zeros(1, 3, H, D, D)
    temporal[0, 0] = S[0].transpose(-1, -2)  # upstream [H, V, K]
    outs = {}
    for dtype in ("fp32", "int8"):
        pool = CheckpointPool.from_active(temporal, None, num_slots=1, dtype=dtype)
        s = pool.alloc(1)
        assert pool.store([0], s).all_ok
        pool.restore(s, [1])
        S1 = temporal[0, 1].transpose(-1, -2).unsqueeze(0).contiguous()
        outs[dtype], _ = naive_recurrent_kda(
            q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=S1
        )
    assert torch.equal(outs["fp32"], o_ref)
    drift = rel(outs["int8"], o_ref)
    print(f"int8 restore: relative output drift over {T - cut} tokens {drift:.4g}")
    assert 0 < drift < 0.02


def test_upstream_mamba_pool_as_active_side():
    pytest.importorskip("sglang")
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=2, head_dim=16, conv_kernel_size=4)
    params = KimiLinearCacheParams(shape=shape, layers=[0, 1, 2])
    mp = MambaPool(size=4, spec_state_size=4, cache_params=params, mamba_layer_ids=[0, 1, 2], device="cpu")
    st = mp.mamba_cache
    st.temporal.copy_(torch.randn_like(st.temporal))
    st.conv[0].copy_(torch.randn_like(st.conv[0], dtype=torch.float32).to(st.conv[0].dtype))
    pool = CheckpointPool.from_mamba_pool(mp, num_slots=2, dtype="fp32")
    assert pool.conv_shape == tuple(shape.conv[0])
    s = pool.alloc(1)
    want_t, want_c = st.temporal[:, 2].clone(), st.conv[0][:, 2].clone()
    pool.store([2], s)
    pool.restore(s, [4])
    assert torch.equal(st.temporal[:, 4], want_t) and torch.equal(st.conv[0][:, 4], want_c)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp32"])
def test_cuda_pool_matches_cpu_pool(dtype):
    t, c = make_active(L=4, S=8, H=4, V=128, Kd=128, conv=(3, 384), seed=9)
    t[3, 6, 1, 2, 3] = float("nan")
    tc, cc = t.cuda(), c.cuda()
    p_cpu = CheckpointPool.from_active(t, c, num_slots=4, dtype=dtype)
    p_gpu = CheckpointPool.from_active(tc, cc, num_slots=4, dtype=dtype)
    assert p_gpu.use_triton is None
    r1 = p_cpu.store([0, 6, 2], p_cpu.alloc(3))
    r2 = p_gpu.store([0, 6, 2], p_gpu.alloc(3))
    assert r1.accepted == r2.accepted == [True, False, True]
    p_cpu.restore([0, 2], [1, 7])
    p_gpu.restore([0, 2], [1, 7])
    # slot 6 keeps its NaN on both sides; compare the restored slots
    assert torch.equal(tc[:, [1, 7]].cpu(), t[:, [1, 7]]) and torch.equal(cc[:, [1, 7]].cpu(), c[:, [1, 7]])
