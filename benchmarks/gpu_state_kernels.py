"""GPU benchmark of the checkpoint state-movement kernels (issue 4), one run does it all.

    python benchmarks/gpu_state_kernels.py --out DIR

Measures, in the same process:
  1. plain copy bandwidth (torch ``dst.copy_(src)``, 2 GiB, the ceiling);
  2. a block-size sweep of our kernels (48B dims, batch 8), the best config is used below;
  3. at Kimi-Linear-48B dims (20 KDA layers x 32 heads x 128 x 128 fp32, conv (3, 12288) bf16) and
     K3 dims (69 KDA layers x 64 heads x 128 x 128 fp32, conv (3, 24576) bf16 -- our assumption: K3
     keeps 128-dim heads and doubles the head count of 48B), batches of 1, 8, 64 slots:
     effective bandwidth (minimum bytes read + written / time) of
       quant_scatter (active fp32 -> int8 ckpt), gather_dequant (int8 -> active fp32),
       copy_to_ckpt / copy_from_ckpt for fp32 and bf16 checkpoints,
     and upstream-style torch ops for the same moves (index_select / amax / round / clamp /
     index_copy), each as a fraction of (1);
     each also as a fraction of a torch copy moving the same number of bytes (a small move pays
     the same launch ramp-up and tail as any kernel of its size);
  4. checkpoint export from chunk_kda at T = 4k, 16k, 64k (48B layer dims, B = 1): chunk_kda with
     vs without ``return_intermediate_states`` plus our ``store_intermediate`` (int8, conv windows
     included) for k3's placement (two states per sequence: the last boundary before the prompt
     end and one at a branch point), every 1024 tokens, and every chunk (worst case), as a
     fraction of the prefill. Device time from the profiler's kernel durations, so a host-bound
     4k call is measured like a big one.
Writes DIR/gpu_state_kernels.json and DIR/gpu_state_kernels.png (``--only`` writes DIR/gpu_PART.json).

Timing: CUDA events around back-to-back launches that rotate over enough distinct slots that one
round's data is well above the 50 MB L2 (so no launch reads what the previous one left in L2);
the median of several such windows. Index tensors are made on the device beforehand (the kernel
cost; the pool's Python-list path adds one small H2D copy per call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

DIMS = {
    "kimi-linear-48b": dict(L=20, H=32, V=128, K=128, conv=(3, 3 * 32 * 128)),
    "k3": dict(L=69, H=64, V=128, K=128, conv=(3, 3 * 64 * 128)),
}
BATCHES = (1, 8, 64)
ROUND_BYTES = 1 << 30  # data touched by one rotation round (>> L2)


def log(*a):
    print(*a, flush=True)


def time_rotating(fns, min_time=0.03, windows=5):
    """fns: list of zero-arg callables (one per rotation set). Returns seconds per call (median)."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) / len(fns), 1e-6)
    n = max(len(fns), int(math.ceil(min_time / est)))
    n = min(n, 2000)
    res = []
    for _ in range(windows):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) / 1e3 / n)
    return statistics.median(res)


def time_graph(fns, min_time=0.03, windows=5):
    """Device time per call: the calls (rotating over fns) captured in one CUDA graph and replayed,
    so host launch overhead is not in the number."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) / len(fns), 1e-6)
    m = max(len(fns), min(256, int(math.ceil(min_time / est))))
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fns[0]()
    torch.cuda.current_stream().wait_stream(st)
    with torch.cuda.graph(g):
        for i in range(m):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    res = []
    for _ in range(windows):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) / 1e3 / m)
    del g
    return statistics.median(res)


def copy_bandwidth(nbytes=2 << 30):
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    # eager: one 2 GiB copy kernel, launch cost negligible. (Captured in a CUDA graph a plain
    # copy_ becomes a memcpy node that ran at only 2.7 TB/s in v2, so not that.)
    t = time_rotating([lambda: b.copy_(a)], windows=7)
    del a, b
    return 2 * nbytes / t


def sized_copy_bandwidth(nbytes):
    """torch copy of the same number of bytes a kernel moves, rotating to defeat L2."""
    n = max(1, nbytes // 2 // 4)
    sets = max(1, min(8, ROUND_BYTES // max(1, 2 * n * 4)))
    bufs = [(torch.empty(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(sets)]
    t = time_rotating([lambda a=a, b=b: b.copy_(a) for a, b in bufs])
    del bufs
    return 2 * n * 4 / t


# ----------------------------------------------------------------------------- torch baselines
# The upstream pool's way of moving states (sglang mem_cache/mamba_checkpoint_pool.py does these
# ops on a layer-major [L, N, H, V, K] store): fancy-index gather, fp32 amax/div/round/clamp, cast,
# fancy-index scatter. Here on our slot-major checkpoint store (index_select/index_copy on dim 0).


def torch_quant(t, c, si, q, s, cc, di):
    x = t.index_select(1, si).transpose(0, 1).float()
    amax = x.abs().amax(dim=-2, keepdim=True).clamp(min=1e-8)
    scale = amax / 127
    qq = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    q.index_copy_(0, di, qq)
    s.index_copy_(0, di, scale.squeeze(-2))
    cc.index_copy_(0, di, c.index_select(1, si).transpose(0, 1).reshape(len(si), c.shape[0], -1))


def torch_dequant(q, s, cc, si, t, c, di):
    x = q.index_select(0, si).float() * s.index_select(0, si).unsqueeze(-2)
    t.index_copy_(1, di, x.transpose(0, 1))
    cv = cc.index_select(0, si).transpose(0, 1)
    c.index_copy_(1, di, cv.reshape((cv.shape[0], cv.shape[1]) + c.shape[2:]))


def torch_move_to(t, c, si, d, dc, di):
    d.index_copy_(0, di, t.index_select(1, si).transpose(0, 1).to(d.dtype))
    dc.index_copy_(0, di, c.index_select(1, si).transpose(0, 1).reshape(len(si), c.shape[0], -1))


def torch_move_from(d, dc, si, t, c, di):
    t.index_copy_(1, di, d.index_select(0, si).transpose(0, 1).to(t.dtype))
    cv = dc.index_select(0, si).transpose(0, 1)
    c.index_copy_(1, di, cv.reshape((cv.shape[0], cv.shape[1]) + c.shape[2:]))


# ----------------------------------------------------------------------------- main measurement


def bytes_of(kind, n, L, H, V, K, conv_n):
    hvk, hk, cb = H * V * K, H * K, conv_n * 2
    per = {
        "quant_scatter": (hvk * 4 + cb) + (hvk + hk * 4 + cb),
        "gather_dequant": (hvk + hk * 4 + cb) + (hvk * 4 + cb),
        "copy_to_ckpt_fp32": 2 * (hvk * 4 + cb),
        "copy_from_ckpt_fp32": 2 * (hvk * 4 + cb),
        "copy_to_ckpt_bf16": (hvk * 4 + cb) + (hvk * 2 + cb),
        "copy_from_ckpt_bf16": (hvk * 2 + cb) + (hvk * 4 + cb),
    }[kind]
    return n * L * per


def bench_dims(name, d, cfg, copy_bw, results, with_torch=True):
    from sglang_k3.kernels.ckpt import triton_kernels as tk

    L, H, V, K = d["L"], d["H"], d["V"], d["K"]
    conv_shape = d["conv"]
    conv_n = conv_shape[0] * conv_shape[1]
    slot_fp32 = L * (H * V * K * 4 + conv_n * 2)
    for n in BATCHES:
        sets = max(1, min(16, math.ceil(ROUND_BYTES / (n * slot_fp32))))
        P = n * sets
        log(f"[{name}] batch {n}: {sets} rotation sets, active pool {P} slots ({P * slot_fp32 / 2**30:.1f} GiB)")
        t = torch.randn(L, P, H, V, K, device="cuda")
        c = torch.randn((L, P) + conv_shape, device="cuda").to(torch.bfloat16)
        idx = [torch.arange(i * n, (i + 1) * n, device="cuda", dtype=torch.int32) for i in range(sets)]
        idx_l = [x.long() for x in idx]
        q = torch.empty(P, L, H, V, K, dtype=torch.int8, device="cuda")
        s = torch.empty(P, L, H, K, device="cuda")
        cc = torch.empty(P, L, conv_n, dtype=torch.bfloat16, device="cuda")
        # the torch baselines materialize several fp32 temporaries of the whole batch: skip them
        # where that would not fit beside the pools (K3, batch 64)
        with_torch_n = with_torch and n * slot_fp32 <= 6 * 2**30
        if not with_torch_n:
            log("  (torch baselines skipped at this size: their temporaries would not fit)")

        same_bytes = {}  # bytes -> bandwidth of a torch copy moving as many bytes (read + write)

        def rec(kernel, impl, fns):
            sec = time_graph(fns)
            eager = time_rotating(fns, windows=3)
            b = bytes_of(kernel, n, L, H, V, K, conv_n)
            if b not in same_bytes:
                same_bytes[b] = sized_copy_bandwidth(b)
            bw = b / sec
            results.append(
                dict(
                    dims=name,
                    batch=n,
                    kernel=kernel,
                    impl=impl,
                    time_us=sec * 1e6,
                    eager_us=eager * 1e6,
                    bytes=b,
                    bw_GBs=bw / 1e9,
                    frac_of_copy=bw / copy_bw,
                    eager_frac_of_copy=b / eager / copy_bw,
                    same_bytes_copy_frac=same_bytes[b] / copy_bw,
                    frac_of_same_bytes_copy=bw / same_bytes[b],
                )
            )
            log(
                f"  {kernel:22s} {impl:7s} {sec * 1e6:10.1f} us  {bw / 1e12:6.3f} TB/s  {bw / copy_bw:6.1%}"
                f"  (of a same-bytes copy {bw / same_bytes[b]:6.1%}; eager {eager * 1e6:.1f} us, "
                f"{b / eager / copy_bw:.1%})"
            )

        flags = torch.zeros(n, dtype=torch.int32, device="cuda")
        qk = dict(cfg["quant"], bad=flags)
        rec(
            "quant_scatter",
            "triton",
            ([lambda i=i: tk.quant_scatter(t, c, idx[i], q, s, cc, idx[i], **qk) for i in range(sets)]),
        )
        dk = cfg["dequant"]
        rec(
            "gather_dequant",
            "triton",
            ([lambda i=i: tk.gather_dequant(q, s, cc, idx[i], t, c, idx[i], **dk) for i in range(sets)]),
        )
        if with_torch_n:
            rec(
                "quant_scatter",
                "torch",
                ([lambda i=i: torch_quant(t, c, idx_l[i], q, s, cc, idx_l[i]) for i in range(min(sets, 4))]),
            )
            rec(
                "gather_dequant",
                "torch",
                ([lambda i=i: torch_dequant(q, s, cc, idx_l[i], t, c, idx_l[i]) for i in range(min(sets, 4))]),
            )
        # correctness spot check in the benchmark itself: dequant(quant(x)) close to x
        x0 = t[:, idx_l[0]].clone()
        tk.quant_scatter(t, c, idx[0], q, s, cc, idx[0], **qk)
        tk.gather_dequant(q, s, cc, idx[0], t, c, idx[0], **dk)
        err = ((t[:, idx_l[0]] - x0).norm() / x0.norm()).item()
        assert err < 0.01, err
        assert int(flags.sum()) == 0  # finite data: no pair flagged
        del q, s
        ck = cfg["copy"]
        ckb = dict(ck, bad=flags)
        for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            dq = torch.empty(P, L, H, V, K, dtype=dt, device="cuda")
            rec(
                f"copy_to_ckpt_{tag}",
                "triton",
                ([lambda i=i: tk.copy_to_ckpt(t, c, idx[i], dq, cc, idx[i], **ckb) for i in range(sets)]),
            )
            rec(
                f"copy_from_ckpt_{tag}",
                "triton",
                ([lambda i=i: tk.copy_from_ckpt(dq, cc, idx[i], t, c, idx[i], **ck) for i in range(sets)]),
            )
            if with_torch_n:
                rec(
                    f"copy_to_ckpt_{tag}",
                    "torch",
                    ([lambda i=i: torch_move_to(t, c, idx_l[i], dq, cc, idx_l[i]) for i in range(min(sets, 4))]),
                )
                rec(
                    f"copy_from_ckpt_{tag}",
                    "torch",
                    ([lambda i=i: torch_move_from(dq, cc, idx_l[i], t, c, idx_l[i]) for i in range(min(sets, 4))]),
                )
            if dt == torch.float32:
                x0 = t[:, idx_l[0]].clone()
                tk.copy_to_ckpt(t, c, idx[0], dq, cc, idx[0], **ck)
                t[:, idx_l[0]] = 0
                tk.copy_from_ckpt(dq, cc, idx[0], t, c, idx[0], **ck)
                assert torch.equal(t[:, idx_l[0]], x0)
            del dq
        del t, c, cc
        torch.cuda.empty_cache()


def sweep(copy_bw, n=8):
    """Launch configs at Kimi-Linear-48B dims for batches of ``n`` slot pairs."""
    from sglang_k3.kernels.ckpt import triton_kernels as tk

    d = DIMS["kimi-linear-48b"]
    L, H, V, K = d["L"], d["H"], d["V"], d["K"]
    conv_n = d["conv"][0] * d["conv"][1]
    sets = 4
    P = n * sets
    t = torch.randn(L, P, H, V, K, device="cuda")
    c = torch.randn((L, P) + d["conv"], device="cuda").to(torch.bfloat16)
    q = torch.empty(P, L, H, V, K, dtype=torch.int8, device="cuda")
    s = torch.empty(P, L, H, K, device="cuda")
    cc = torch.empty(P, L, conv_n, dtype=torch.bfloat16, device="cuda")
    dq = torch.empty(P, L, H, V, K, device="cuda")
    idx = [torch.arange(i * n, (i + 1) * n, device="cuda", dtype=torch.int32) for i in range(sets)]
    out, best = [], {}
    for kind in ("quant", "dequant"):
        for BK in (8, 16, 32, 64, 128):
            for nw in (1, 2, 4, 8):
                kw = dict(BK=BK, num_warps=nw)
                if kind == "quant":
                    fns = [lambda i=i: tk.quant_scatter(t, c, idx[i], q, s, cc, idx[i], **kw) for i in range(sets)]
                    b = bytes_of("quant_scatter", n, L, H, V, K, conv_n)
                else:
                    fns = [lambda i=i: tk.gather_dequant(q, s, cc, idx[i], t, c, idx[i], **kw) for i in range(sets)]
                    b = bytes_of("gather_dequant", n, L, H, V, K, conv_n)
                frac = b / time_graph(fns, windows=3) / copy_bw
                out.append(dict(kind=kind, cfg=kw, frac_of_copy=frac))
                log(f"  sweep {kind:7s} {kw} {frac:6.1%}")
                if frac > best.get(kind, (0, None))[0]:
                    best[kind] = (frac, kw)
    for BT in (1024, 2048, 4096, 8192):
        for nw in (4, 8):
            kw = dict(BT=BT, num_warps=nw)
            fns = [lambda i=i: tk.copy_to_ckpt(t, c, idx[i], dq, cc, idx[i], **kw) for i in range(sets)]
            fns2 = [lambda i=i: tk.copy_from_ckpt(dq, cc, idx[i], t, c, idx[i], **kw) for i in range(sets)]
            b = bytes_of("copy_to_ckpt_fp32", n, L, H, V, K, conv_n)
            frac = 0.5 * (b / time_graph(fns, windows=3) + b / time_graph(fns2, windows=3)) / copy_bw
            out.append(dict(kind="copy", cfg=kw, frac_of_copy=frac))
            log(f"  sweep copy    {kw} {frac:6.1%}")
            if frac > best.get("copy", (0, None))[0]:
                best["copy"] = (frac, kw)
    del t, c, q, s, cc, dq
    torch.cuda.empty_cache()
    return out, {k: v[1] for k, v in best.items()}


def device_time(fn, iters=10):
    """Device-busy time per call: the sum of the GPU kernel (and memcpy/memset) durations the
    profiler records over ``iters`` calls, divided by ``iters``. Host launch gaps are not in it,
    so a host-bound call (chunk_kda at 4k tokens) is measured by its kernels, like a big one."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    if total <= 0:
        raise RuntimeError("the profiler recorded no device time")
    return total / iters / 1e6


def bench_export(results, cfg):
    import torch.nn.functional as F
    from fla.ops.kda import chunk_kda

    from sglang_k3.kernels.ckpt import triton_kernels as tk

    d = DIMS["kimi-linear-48b"]
    H, D = d["H"], d["K"]
    conv_d = d["conv"][1]
    for T in (4096, 16384, 65536):
        torch.manual_seed(0)
        q = F.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1).to(torch.bfloat16)
        k = F.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1).to(torch.bfloat16)
        v = torch.randn(1, T, H, D, device="cuda").to(torch.bfloat16)
        g = F.logsigmoid(torch.randn(1, T, H, D, device="cuda") + 4)
        beta = torch.sigmoid(torch.randn(1, T, H, device="cuda")).to(torch.bfloat16)
        h0 = torch.zeros(1, H, D, D, device="cuda")
        stream = torch.randn(T, conv_d, device="cuda").to(torch.bfloat16)
        NT = T // 64
        nck_sparse = T // 1024
        qck = torch.empty(NT, 1, H, D, D, dtype=torch.int8, device="cuda")
        sck = torch.empty(NT, 1, H, D, device="cuda")
        cck = torch.empty(NT, 1, 3 * conv_d, dtype=torch.bfloat16, device="cuda")

        with torch.inference_mode():

            def base():
                return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

            def with_h():
                return chunk_kda(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True, return_intermediate_states=True
                )

            for _ in range(3):
                base()
                _, _, h = with_h()
            sparse_ci = torch.arange(16, NT, 16, device="cuda", dtype=torch.int32)[: max(1, nck_sparse - 1)]
            all_ci = torch.arange(1, NT, device="cuda", dtype=torch.int32)
            sl_sparse = torch.arange(len(sparse_ci), device="cuda", dtype=torch.int32)
            sl_all = torch.arange(len(all_ci), device="cuda", dtype=torch.int32)
            te_sparse, te_all = (sparse_ci * 64), (all_ci * 64)

            eflags = torch.zeros(NT, dtype=torch.int32, device="cuda")

            def store(ci, sl, te):
                return lambda: tk.store_intermediate(
                    h, ci, 0, qck, sck, sl, conv_src=stream, token_ends=te, dst_conv=cck, bad=eflags, **cfg["quant"]
                )

            # check: stored checkpoint == quantized h
            store(sparse_ci, sl_sparse, te_sparse)()
            from sglang_k3.kernels.ckpt import reference as R

            qr, sr = R.quantize_tile(h.reshape(-1, H, D, D)[sparse_ci[0].long()].float().transpose(-1, -2))
            mism = int((qck[0, 0] != qr).sum()), int((sck[0, 0] != sr).sum())
            log(f"  export check: int8 code mismatches {mism[0]}, scale mismatches {mism[1]}")

            # k3's placement keeps at most two exported states per sequence and forward: the
            # last chunk boundary before the prompt end and the one at or below a branch point
            k3_ci = torch.tensor([NT // 2, NT - 1], device="cuda", dtype=torch.int32)
            sl_k3 = torch.arange(2, device="cuda", dtype=torch.int32)
            te_k3 = k3_ci * 64
            tb, th = [], []
            for _ in range(3):  # interleave to cancel drift; device time (profiler): no host gaps
                tb.append(device_time(base))
                th.append(device_time(with_h))
            t_base, t_h = statistics.median(tb), statistics.median(th)
            t_sparse = device_time(store(sparse_ci, sl_sparse, te_sparse), iters=20)
            t_all = device_time(store(all_ci, sl_all, te_all), iters=20)
            t_k3 = device_time(store(k3_ci, sl_k3, te_k3), iters=20)
            t_base_eager = time_rotating([base], min_time=0.1, windows=3)
        row = dict(
            T=T,
            H=H,
            D=D,
            timing="device time (profiler kernel durations)",
            chunk_kda_us=t_base * 1e6,
            chunk_kda_with_h_us=t_h * 1e6,
            chunk_kda_eager_wall_us=t_base_eager * 1e6,
            store_every_1024_us=t_sparse * 1e6,
            n_ckpt_sparse=len(sparse_ci),
            store_every_chunk_us=t_all * 1e6,
            n_ckpt_all=len(all_ci),
            store_k3_placement_us=t_k3 * 1e6,
            n_ckpt_k3=2,
            overhead_k3=(t_h - t_base + t_k3) / t_base,
            overhead_sparse=(t_h - t_base + t_sparse) / t_base,
            overhead_all=(t_h - t_base + t_all) / t_base,
            return_h_delta=(t_h - t_base) / t_base,
            check_mismatches=mism,
        )
        results.append(row)
        log(
            f"[export T={T}] chunk_kda {t_base * 1e6:.0f} us device ({t_base_eager * 1e6:.0f} us eager wall), "
            f"with h {t_h * 1e6:.0f} us; store 2 (k3) {t_k3 * 1e6:.1f} us, {len(sparse_ci)} ckpts "
            f"{t_sparse * 1e6:.1f} us, {len(all_ci)} ckpts {t_all * 1e6:.1f} us -> overhead "
            f"{row['overhead_k3']:.2%} (k3) / {row['overhead_sparse']:.2%} (every 1024) / "
            f"{row['overhead_all']:.2%} (every chunk)"
        )
        del q, k, v, g, beta, h, qck, sck, cck, stream
        torch.cuda.empty_cache()


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["kernels"] if r["kernel"] != "same_size_copy"]
    kernels = sorted({r["kernel"] for r in rows}, key=lambda k: [r["kernel"] for r in rows].index(k))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, dims in zip(axes[:2], DIMS):
        width = 0.12
        for bi, n in enumerate(BATCHES):
            for ii, impl in enumerate(("triton", "torch")):
                ys = []
                for kname in kernels:
                    m = [
                        r
                        for r in rows
                        if r["dims"] == dims and r["batch"] == n and r["kernel"] == kname and r["impl"] == impl
                    ]
                    ys.append(m[0]["frac_of_copy"] if m else 0)
                xs = [i + (bi * 2 + ii - 2.5) * width for i in range(len(kernels))]
                ax.bar(xs, ys, width, label=f"{impl} b={n}", alpha=1.0 if impl == "triton" else 0.45, color=f"C{bi}")
                if impl == "triton":  # black tick: a torch copy moving the same bytes
                    sb = [
                        next(
                            (
                                r.get("same_bytes_copy_frac")
                                for r in rows
                                if r["dims"] == dims and r["batch"] == n and r["kernel"] == kname
                            ),
                            None,
                        )
                        for kname in kernels
                    ]
                    pts = [(x, y) for x, y in zip(xs, sb) if y is not None]
                    if pts:
                        ax.scatter(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            marker="_",
                            color="k",
                            s=60,
                            zorder=3,
                            label="same-bytes torch copy" if bi == 0 else None,
                        )
        ax.axhline(0.85, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(kernels)))
        ax.set_xticklabels(kernels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("fraction of copy bandwidth")
        ax.set_title(f"{dims} (copy {data['copy_bw_TBs']:.2f} TB/s)")
        ax.legend(fontsize=7, ncol=3)
    ex = data["export"]
    ax = axes[2]
    Ts = [r["T"] for r in ex]
    if all("overhead_k3" in r for r in ex):
        ax.plot(Ts, [100 * r["overhead_k3"] for r in ex], "^-", label="h export + store 2 (k3 placement)")
    ax.plot(Ts, [100 * r["overhead_sparse"] for r in ex], "o-", label="h export + store every 1024 tok")
    ax.plot(Ts, [100 * r["overhead_all"] for r in ex], "s-", label="h export + store every chunk")
    ax.axhline(2, color="k", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("overhead vs chunk_kda, %")
    ax.set_title("checkpoint export from chunk_kda (48B layer)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--plot-only", default=None, help="re-plot from an existing JSON")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--only",
        choices=("kernels", "export"),
        default=None,
        help="run one part: the kernel table or the chunk_kda export (writes gpu_PART.json)",
    )
    ap.add_argument(
        "--sweep-only-batch",
        type=int,
        default=None,
        metavar="N",
        help="only sweep launch configs for batches of N slot pairs; write sweep_bN.json",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), os.path.join(args.out, "gpu_state_kernels.png"))
        return
    assert torch.cuda.is_available(), "needs a GPU"
    import triton

    data = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        dims=DIMS,
        batches=BATCHES,
    )
    t0 = time.time()
    copy_bw = copy_bandwidth()
    data["copy_bw_TBs"] = copy_bw / 1e12
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    if args.sweep_only_batch:
        rows, best = sweep(copy_bw, n=args.sweep_only_batch)
        with open(os.path.join(args.out, f"gpu_sweep_b{args.sweep_only_batch}.json"), "w") as f:
            json.dump(dict(data, batch=args.sweep_only_batch, sweep=rows, best=best), f, indent=1)
        log(f"best at batch {args.sweep_only_batch}: {best}")
        return
    # the wrappers' defaults (the v3/v4 sweeps' best) unless this run sweeps again
    cfg = dict(quant={}, dequant={}, copy={})
    if not args.no_sweep and args.only is None:
        data["sweep"], best = sweep(copy_bw)
        cfg.update(best)
    data["config"] = cfg
    log(f"config {cfg}  ({time.time() - t0:.0f} s)")
    path = os.path.join(args.out, "gpu_state_kernels.json" if args.only is None else f"gpu_{args.only}.json")

    def dump():
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    data["kernels"] = []
    dump()
    for name, d in DIMS.items() if args.only in (None, "kernels") else ():
        bench_dims(name, d, cfg, copy_bw, data["kernels"])
        dump()
        log(f"({time.time() - t0:.0f} s)")
    data["export"] = []
    try:
        if args.only in (None, "export"):
            bench_export(data["export"], cfg)
    except Exception as e:  # recorded, not hidden
        data["export_error"] = repr(e)
        log("export benchmark failed:", repr(e))
    data["wall_s"] = time.time() - t0
    dump()
    try:
        if args.only is None:
            plot(data, os.path.join(args.out, "gpu_state_kernels.png"))
    except Exception as e:
        log("plot failed:", repr(e))
    log(f"wrote {path} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
