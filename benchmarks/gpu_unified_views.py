"""GPU check of the unified memory buffer at Kimi-Linear-48B dimensions.

    python benchmarks/gpu_unified_views.py --out DIR

One CUDA buffer cut by the server's ``plan_geometry`` (48B: MLA KV 8,064 B/token over 7 layers,
20 KDA layers x 32 heads x 128 x 128 fp32 + conv (3, 12288) bf16 per state), with the server's
views (``UnifiedBuffer``) and ledger. For each checkpoint dtype (int8, bf16, fp32):

* 8 active states are stored into checkpoints and restored into 8 other active slots by the Triton
  kernels, through the strided views; the restored states are compared with the same store/restore
  done by the pure-torch reference on contiguous CPU tensors;
* every byte the operations may not touch (KV tokens, other blocks) is compared before and after
  (a state slot spans ``active_span`` blocks: the geometry sizes blocks for a checkpoint);
* store and restore device time (CUDA events, median of 20) through the views is set against the
  same kernels on a contiguous pool of their own.

Writes DIR/gpu_unified_views.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from sglang_k3.cache.block_ledger import BlockLedger, plan_geometry
from sglang_k3.state.checkpoint_pool import CheckpointPool, parse_checkpoint_dtype
from sglang_k3.state.checkpoint_store import LedgerSlots
from sglang_k3.state.unified_buffer import CheckpointLayout, StateLayout, UnifiedBuffer

L, H, V, K = 20, 32, 128, 128
CONV = (3, 12288)
KV_LAYERS, KV_DIM = 7, 576
N = 8


def _time(fn, reps=20, setup=None) -> float:
    """Median microseconds of ``fn`` (CUDA events; wall clock on CPU), ``setup`` untimed."""
    import time

    ts = []
    for _ in range(reps):
        arg = setup() if setup else None
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(arg)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(arg)
            ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def run(dtype: str, budget: int) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = StateLayout(temporal=(L, H, V, K), temporal_dtype=torch.float32, conv=(L, *CONV), conv_dtype=torch.bfloat16)
    ck = CheckpointLayout.of_state(state, parse_checkpoint_dtype(dtype))
    geom = plan_geometry(budget, kv_token_bytes=KV_LAYERS * KV_DIM * 2, active_bytes=state.nbytes, ckpt_bytes=ck.nbytes)
    led = BlockLedger(geom, active_reserve=2 * N)
    buf = UnifiedBuffer(geom, device=dev)
    kv = buf.kv_layer_views(KV_LAYERS, KV_DIM, torch.bfloat16)
    temporal, conv = buf.state_views(state)
    tokens = led.kv_alloc(3 * geom.kv_per_block + 17)
    src = [led.active_alloc() for _ in range(N)]
    dst = [led.active_alloc() for _ in range(N)]
    g = torch.Generator(device=dev).manual_seed(7)
    t_idx = torch.tensor(tokens, device=dev)
    for layer in kv:
        layer[t_idx] = torch.randn(len(tokens), 1, KV_DIM, generator=g, device=dev).to(torch.bfloat16)
    s_idx = torch.tensor(src, device=dev)
    temporal[:, s_idx] = torch.randn(L, N, H, V, K, generator=g, device=dev)
    conv[:, s_idx] = torch.randn(L, N, *CONV, generator=g, device=dev).to(torch.bfloat16)
    pool = CheckpointPool.from_active(
        temporal,
        conv,
        num_slots=geom.num_blocks * geom.ckpt_per_block,
        dtype=dtype,
        buffers=buf.checkpoint_views(ck),
        slots=LedgerSlots(led),
    )
    handles = pool.alloc(N)
    span = geom.active_span  # a state slot is ``span`` blocks

    def slot_blocks(slots):
        return {b for s in slots for b in range(s * span, (s + 1) * span)}

    owned = slot_blocks(src + dst) | {h // geom.ckpt_per_block for h in handles}
    before = buf.raw.clone()
    res = pool.store(src, handles)
    assert res.all_ok
    pool.restore(handles, dst)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    # bytes outside the written blocks (dst slots, checkpoint blocks) are untouched
    blocks_b, blocks_a = before.view(geom.num_blocks, -1), buf.raw.view(geom.num_blocks, -1)
    written = {h // geom.ckpt_per_block for h in handles} | slot_blocks(dst)
    untouched = [b for b in range(geom.num_blocks) if b not in written]
    others_equal = bool(torch.equal(blocks_b[untouched], blocks_a[untouched]))
    # the torch reference on contiguous CPU tensors
    tc, cc = temporal[:, s_idx].cpu(), conv[:, s_idx].cpu()
    ref = CheckpointPool.from_active(
        torch.zeros(L, 2 * N, H, V, K),
        torch.zeros(L, 2 * N, *CONV, dtype=torch.bfloat16),
        num_slots=N,
        dtype=dtype,
        use_triton=False,
    )
    ref.active_temporal[:, :N], ref.active_conv[:, :N] = tc, cc
    rh = ref.alloc(N)
    ref.store(list(range(N)), rh)
    ref.restore(rh, list(range(N, 2 * N)))
    d_idx = torch.tensor(dst, device=dev)
    got_t, got_c = temporal[:, d_idx].cpu(), conv[:, d_idx].cpu()
    want_t, want_c = ref.active_temporal[:, N:], ref.active_conv[:, N:]
    max_t = float((got_t - want_t).abs().max())
    conv_equal = bool(torch.equal(got_c, want_c))
    # device time through the views vs a contiguous pool of its own
    own = CheckpointPool.from_active(temporal, conv, num_slots=2 * N, dtype=dtype)
    oh = own.alloc(N)
    own.store(src, oh)

    def fresh(p):
        def make():
            hs = p.alloc(N)
            return hs

        return make

    reps = 20 if dev.type == "cuda" else 3
    t_store_views = _time(lambda hs: (pool.store(src, hs), pool.decref(hs)), reps, fresh(pool))
    t_store_own = _time(lambda hs: (own.store(src, hs), own.decref(hs)), reps, fresh(own))
    t_restore_views = _time(lambda _: pool.restore(handles, dst), reps)
    t_restore_own = _time(lambda _: own.restore(oh, dst), reps)
    return {
        "dtype": dtype,
        "geometry": {
            "budget_bytes": geom.budget_bytes,
            "block_bytes": geom.block_bytes,
            "num_blocks": geom.num_blocks,
            "kv_tokens_per_block": geom.kv_per_block,
            "checkpoints_per_block": geom.ckpt_per_block,
            "checkpoint_bytes": ck.nbytes,
            "checkpoint_stride": geom.ckpt_stride,
            "active_span_blocks": geom.active_span,
        },
        "restored_vs_torch_reference_max_abs_diff": max_t,
        "restored_conv_equal": conv_equal,
        "untouched_blocks_equal": others_equal,
        "owned_blocks": len(owned),
        "store_us_views": t_store_views,
        "store_us_own_pool": t_store_own,
        "restore_us_views": t_restore_views,
        "restore_us_own_pool": t_restore_own,
        "store_ratio_views_over_own": t_store_views / t_store_own,
        "restore_ratio_views_over_own": t_restore_views / t_restore_own,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_unified_views.json")
    ap.add_argument("--budget-gib", type=float, default=4.0, help="unified budget (default 4 GiB)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "runs": [run(d, int(a.budget_gib * (1 << 30))) for d in ("int8", "bf16", "fp32")],
    }
    with open(os.path.join(a.out, "gpu_unified_views.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
