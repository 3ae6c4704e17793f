"""GPU check of the export stash at Kimi-Linear-48B dimensions: memory held and store equivalence.

    python benchmarks/gpu_export_stash.py --out DIR

One 64k-token extend of one sequence (prompt end reached, a branch point at 30,000), 20 KDA layers,
each handing the stash chunk_kda-shaped exports: ``h`` bf16 ``[1, 1024, 32, 128, 128]`` (1 GiB) and
the pre-conv stream ``mixed_qkv`` bf16 ``[65536, 12288]`` (1.5 GiB). Measured with
``torch.cuda.memory_allocated``:

* ``stash``: the current ExportStash (only the planned rows are copied; the exports are released
  after each layer, as in a forward);
* ``references``: the previous behaviour, a reference to each layer's ``h`` and ``mixed_qkv`` kept
  until the next forward.

Also: ``record_layer`` device time per layer (CUDA events), and that an int8 store through the
Triton ``store_intermediate`` kernel from the compact rows equals one from the full tensors (the
previous code path), byte for byte.

And the cost the scheduler pays per exported checkpoint (wall time, host + device, as the cache
calls it): storing all 20 layers from the stacked rows in one ``store_from_intermediate`` call
(one launch, one refusal-flag sync) against 20 per-layer calls (20 launches, 20 syncs), with the
two results compared byte for byte. And for a forward of many sequences, its 64 kept rows stored
in one call (what the int8 store does ahead, at the first request's checkpoint) against one call per
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from sglang_k3.cache import PlacementPolicy
from sglang_k3.state.checkpoint_pool import CheckpointPool
from sglang_k3.state.export_stash import CHUNK, ExportStash

L, H, V, KD, D, WIDTH = 20, 32, 128, 128, 12288, 3
T, PROMPT, BRANCH = 65536, 65536, 30000
GIB = 1 << 30


def exports(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nt = -(-T // CHUNK)
    h = torch.randn(1, nt, H, V, KD, device="cuda", dtype=torch.bfloat16, generator=g)
    mixed = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return h, mixed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    pol = PlacementPolicy()
    stash = ExportStash()
    stash.enable(lambda rid, seq: list(pol.export_candidates(seq.grid(), seq.end, PROMPT, BRANCH)), WIDTH, num_layers=L)
    res: dict = {"dims": dict(layers=L, heads=H, v=V, k=KD, d=D, width=WIDTH, tokens=T)}

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    times = []
    first = None
    for layer in range(L):
        if stash.starts_forward(1, layer):
            stash.begin(1, [1], [0], [T], rids=["r"])
        h, mixed = exports(layer)
        if layer == 0:
            first = (h.clone(), mixed.clone())
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        stash.record_layer(layer, h, mixed)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
        del h, mixed
    torch.cuda.synchronize()
    held_first = sum(t.numel() * t.element_size() for t in first)
    res["stash"] = dict(
        allocated_after_forward=torch.cuda.memory_allocated() - base - held_first,
        stash_bytes=stash.stash_bytes(),
        rows_kept=sorted(p for _, p in stash._rows),
        exported_bytes=stash.peak_exported_bytes,
        record_layer_us=dict(median=sorted(times)[len(times) // 2], max=max(times)),
    )

    # int8 checkpoints through the Triton kernel: compact rows vs the full tensors (layer 0).
    seq = stash.lookup(1, T)
    pool_a = CheckpointPool(
        num_slots=4,
        num_layers=L,
        num_heads=H,
        head_v_dim=V,
        head_k_dim=KD,
        conv_shape=(WIDTH, D),
        conv_dtype=torch.bfloat16,
        dtype="int8",
        device="cuda",
    )
    pool_b = CheckpointPool(
        num_slots=4,
        num_layers=L,
        num_heads=H,
        head_v_dim=V,
        head_k_dim=KD,
        conv_shape=(WIDTH, D),
        conv_dtype=torch.bfloat16,
        dtype="int8",
        device="cuda",
    )
    h, mixed = first
    same = {}
    for pos in res["stash"]["rows_kept"]:
        j = stash.row(seq, pos)
        rows = stash.layers[0]
        a, b = pool_a.alloc(1), pool_b.alloc(1)
        ra = pool_a.store_from_intermediate(
            0, rows.h, [j], a, state_v_first=True, conv_src=rows.conv.reshape(-1, D), token_ends=[(j + 1) * WIDTH]
        )
        rb = pool_b.store_from_intermediate(
            0, h, [pos // CHUNK], b, state_v_first=True, conv_src=mixed, token_ends=[pos]
        )
        torch.cuda.synchronize()
        same[pos] = bool(
            ra.all_ok
            and rb.all_ok
            and torch.equal(pool_a.q[a[0], 0], pool_b.q[b[0], 0])
            and torch.equal(pool_a.scale[a[0], 0], pool_b.scale[b[0], 0])
            and torch.equal(pool_a.conv[a[0], 0], pool_b.conv[b[0], 0])
            and torch.equal(rows.h[j], h[0, pos // CHUNK])
            and torch.equal(rows.conv[j], mixed[pos - WIDTH : pos])
        )
    res["int8_store_compact_equals_full"] = same

    # One checkpoint, all layers: one stacked call vs one call per layer (the cache's two paths).
    stack = stash.stacked()
    assert stack is not None and list(stash.layers) == list(range(L))
    n = stack.conv.shape[1]
    pool = CheckpointPool(
        num_slots=8,
        num_layers=L,
        num_heads=H,
        head_v_dim=V,
        head_k_dim=KD,
        conv_shape=(WIDTH, D),
        conv_dtype=torch.bfloat16,
        dtype="int8",
        device="cuda",
    )

    def per_layer(j):
        dst = pool.alloc(1)
        for layer in range(L):
            rows = stash.layers[layer]
            r = pool.store_from_intermediate(
                layer,
                rows.h,
                [j],
                dst,
                state_v_first=True,
                conv_src=rows.conv.reshape(-1, D),
                token_ends=[(j + 1) * WIDTH],
            )
            assert r.all_ok
        return dst[0]

    def one_call(j):
        dst = pool.alloc(1)
        r = pool.store_from_intermediate(
            range(L),
            stack.h,
            [j],
            dst,
            state_v_first=True,
            conv_src=stack.conv.reshape(L, n * WIDTH, D),
            token_ends=[(j + 1) * WIDTH],
        )
        assert r.all_ok
        return dst[0]

    equal = []
    for j in range(n):
        a, b = per_layer(j), one_call(j)
        torch.cuda.synchronize()
        equal.append(
            bool(
                torch.equal(pool.q[a], pool.q[b])
                and torch.equal(pool.scale[a], pool.scale[b])
                and torch.equal(pool.conv[a], pool.conv[b])
            )
        )
        pool.decref([a, b])
    walls = {"per_layer": [], "one_call": []}
    for it in range(30):
        for name, fn in (("per_layer", per_layer), ("one_call", one_call)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            slot = fn(it % n)
            torch.cuda.synchronize()
            walls[name].append((time.perf_counter() - t0) * 1e6)
            pool.decref([slot])
    med = {k: statistics.median(v[3:]) for k, v in walls.items()}  # the first calls compile
    res["store_one_checkpoint_all_layers"] = dict(
        wall_us_median=med,
        speedup=med["per_layer"] / med["one_call"],
        results_equal=equal,
        launches=dict(per_layer=L, one_call=1),
        flag_syncs=dict(per_layer=L, one_call=1),
    )
    del pool, stack

    # A forward of many sequences: its kept rows for all requests in one call (stored ahead) vs
    # one call per checkpoint (each already one launch for all layers).
    n_rows = 64
    g = torch.Generator(device="cuda").manual_seed(7)
    hs = torch.randn(L, n_rows, H, V, KD, device="cuda", dtype=torch.bfloat16, generator=g)
    cs = torch.randn(L, n_rows, WIDTH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pool = CheckpointPool(
        num_slots=2 * n_rows,
        num_layers=L,
        num_heads=H,
        head_v_dim=V,
        head_k_dim=KD,
        conv_shape=(WIDTH, D),
        conv_dtype=torch.bfloat16,
        dtype="int8",
        device="cuda",
    )
    conv_src = cs.reshape(L, n_rows * WIDTH, D)
    rows = list(range(n_rows))

    def each():
        out = []
        for r in rows:
            dst = pool.alloc(1)
            assert pool.store_from_intermediate(
                range(L), hs, [r], dst, state_v_first=True, conv_src=conv_src, token_ends=[(r + 1) * WIDTH]
            ).all_ok
            out += dst
        return out

    def ahead():
        dst = pool.alloc(n_rows)
        assert pool.store_from_intermediate(
            range(L), hs, rows, dst, state_v_first=True, conv_src=conv_src, token_ends=[(r + 1) * WIDTH for r in rows]
        ).all_ok
        return dst

    a, b = each(), ahead()
    torch.cuda.synchronize()
    same_rows = all(
        torch.equal(pool.q[x], pool.q[y])
        and torch.equal(pool.scale[x], pool.scale[y])
        and torch.equal(pool.conv[x], pool.conv[y])
        for x, y in zip(a, b)
    )
    pool.decref(a + b)
    walls = {"per_checkpoint": [], "one_call": []}
    for _ in range(12):
        for name, fn in (("per_checkpoint", each), ("one_call", ahead)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            walls[name].append((time.perf_counter() - t0) * 1e6)
            pool.decref(got)
    med = {k: statistics.median(v[2:]) for k, v in walls.items()}
    res["store_forward_rows"] = dict(
        rows=n_rows, wall_us_median=med, speedup=med["per_checkpoint"] / med["one_call"], results_equal=same_rows
    )
    del pool, hs, cs, conv_src
    del first, h, mixed, pool_a, pool_b, stash, seq
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    # The previous behaviour: a reference to every layer's exports until the next forward.
    base = torch.cuda.memory_allocated()
    kept = []
    for layer in range(L):
        kept.append(exports(layer))
    torch.cuda.synchronize()
    res["references"] = dict(allocated_after_forward=torch.cuda.memory_allocated() - base)
    del kept
    torch.cuda.empty_cache()

    s, r = res["stash"]["allocated_after_forward"], res["references"]["allocated_after_forward"]
    print(
        f"held after a 64k-token extend, 20 KDA layers: stash {s / 2**20:.1f} MiB, "
        f"references {r / GIB:.1f} GiB ({r / max(s, 1):.0f}x)"
    )
    st = res["store_one_checkpoint_all_layers"]
    print(
        f"store one checkpoint, {L} layers: one call {st['wall_us_median']['one_call']:.0f} us, per layer "
        f"{st['wall_us_median']['per_layer']:.0f} us ({st['speedup']:.1f}x); equal: {st['results_equal']}"
    )
    fr = res["store_forward_rows"]
    print(
        f"store {fr['rows']} checkpoints of a forward: one call {fr['wall_us_median']['one_call']:.0f} us, one per "
        f"checkpoint {fr['wall_us_median']['per_checkpoint']:.0f} us ({fr['speedup']:.1f}x); "
        f"equal: {fr['results_equal']}"
    )
    print(
        f"record_layer: median {res['stash']['record_layer_us']['median']:.0f} us per layer; "
        f"rows kept at {res['stash']['rows_kept']}; int8 compact == full: {same}"
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_export_stash.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
