"""GPU measurement of the lower tiers' moves at Kimi-Linear-48B dimensions (issue 13).

    python benchmarks/gpu_tier_moves.py --out DIR

A batch of INT8 checkpoints (48B: 20 KDA layers x 32 heads x 128 x 128 int8 + fp32 scales + conv
(3, 12288) bf16: 12.3 MB each) and MLA KV pages (7 layers x 576 bf16 = 8,064 B/token) on one H200,
moved device -> host -> device:

* ``shipped``: what ``--k3-host-tier-gib`` runs: the tier manager over a host store and the
  server's :class:`~sglang_k3.tiers.torch_io.PoolTierIO`, one boundary at a time (a checkpoint and
  the KV of its prefix, as 64-token block objects and a tail), saved, then found and loaded, with
  keys, hashing, the checked object format and the store included. The store is cleared before
  each save: the first writes into fresh memory (``save_first_*``), the later ones into the spare
  buffers the clear left, as a full host tier's saves do (the median, ``save_*``);
* ``shipped_writer``: the same saves with the writer thread on (``--k3-tier-write-queue-mib``, the
  server's default): ``caller_s`` is what the saves take on the caller's (the scheduler's)
  thread, the read off the device into the new objects; ``landed_s`` until every write landed;
* ``pinned_batch``: the same bytes gathered into one pinned host buffer with non-blocking copies
  and one synchronisation per direction (what a batched tier IO would do);
* the link itself: one 256 MiB pinned copy each way, the reference every fraction is taken of.

Every round trip is checked byte for byte. Writes DIR/gpu_tier_moves.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from sglang_k3.state.checkpoint_pool import CheckpointPool
from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.keys import Namespace
from sglang_k3.tiers.manager import TierManager
from sglang_k3.tiers.torch_io import PoolTierIO, host_buffers_for

L, H, V, K = 20, 32, 128, 128
CONV = (3, 12288)
KV_LAYERS, KV_DIM = 7, 576


def _wall(fn, reps: int) -> float:
    return statistics.median(_walls(fn, reps))


def _walls(fn, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoints", type=int, default=8, help="checkpoints per batch")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="MLA KV tokens per batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true", help="run on CPU (checks the script, measures nothing useful)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin = dev.type == "cuda"
    n, T = args.checkpoints, args.kv_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    temporal = torch.randn(L, n, H, V, K, device=dev, generator=g)
    conv = torch.randn(L, n, *CONV, device=dev, generator=g).to(torch.bfloat16)
    pool = CheckpointPool.from_active(temporal, conv, num_slots=2 * n, dtype="int8")
    slots = pool.alloc(n)
    assert pool.store(list(range(n)), slots).all_ok
    kv = [torch.randn(2 * T + 1, 1, KV_DIM, device=dev, generator=g).to(torch.bfloat16) for _ in range(KV_LAYERS)]
    io = PoolTierIO(kv, pool)
    src_kv, dst_kv = list(range(T)), list(range(T, 2 * T))
    state_b, kv_b = io.state_bytes * n, io.kv_token_bytes * T
    total = state_b + kv_b
    res = {
        "device": torch.cuda.get_device_name() if pin else "cpu",
        "torch": torch.__version__,
        "checkpoint_bytes": io.state_bytes,
    }
    res["batch"] = {"checkpoints": n, "kv_tokens": T, "state_bytes": state_b, "kv_bytes": kv_b}

    # the link: one 256 MiB pinned copy each way
    big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=pin)
    d2h = _wall(lambda: host.copy_(big, non_blocking=True), args.reps)
    h2d = _wall(lambda: big.copy_(host, non_blocking=True), args.reps)
    res["link_gbps"] = {"d2h_pinned": (256 << 20) / d2h / 1e9, "h2d_pinned": (256 << 20) / h2d / 1e9}

    # shipped: the tier manager the server runs, over a host store: n boundaries of T/n tokens each
    # (a state and the KV of its prefix: 64-token blocks + the tail), saved, then found and loaded
    per = T // n
    toks = [[(b * 7919 + i) % 50000 for i in range(per - 7)] for b in range(n)]  # ends mid-block
    host_store = HostStore(4 * total, alloc=host_buffers_for(dev))  # as the server builds it
    mgr = TierManager([host_store], Namespace("gpu", "gpu", io.layout), io)

    def save() -> None:
        host_store.clear()
        for b in range(n):
            mgr.save(toks[b], src_kv[b * per : (b + 1) * per], len(toks[b]), slots[b])

    save_times = _walls(save, args.reps)
    t_save = statistics.median(save_times)
    fresh = pool.alloc(n)

    def load() -> None:
        for b, s in enumerate(fresh):
            pool._sealed[s] = False  # re-load into the same slot each repetition
            plan = mgr.find(toks[b] + [1], 0, len(toks[b]), 0)
            assert plan is not None and plan.pos == len(toks[b])
            assert mgr.load(plan, dst_kv[b * per : b * per + plan.pos], s) is not None

    t_load = _wall(load, args.reps)
    ok = all(
        torch.equal(pool.q[a], pool.q[b]) and torch.equal(pool.scale[a], pool.scale[b]) for a, b in zip(slots, fresh)
    )
    moved = [i for b in range(n) for i in range(b * per, b * per + len(toks[b]))]
    ok = ok and all(torch.equal(b[moved], b[[T + i for i in moved]]) for b in kv)
    moved_bytes = state_b + len(moved) * io.kv_token_bytes
    res["shipped"] = {
        # the first save writes into fresh memory; later ones into the buffers the host store's
        # clear() left as spares, as a full host tier's saves do into what it evicts
        "save_first_s": save_times[0],
        "save_first_gbps": moved_bytes / save_times[0] / 1e9,
        "save_s": t_save,
        "load_s": t_load,
        "host_buffers_pinned": host_store.stats().get("tier_host_pin_registered", 0),
        "host_buffers_pin_failures": host_store.stats().get("tier_host_pin_failures", 0),
        "save_gbps": moved_bytes / t_save / 1e9,
        "load_gbps": moved_bytes / t_load / 1e9,
    }

    # shipped, with the writer thread: the caller reads off the device, the writer seals and puts
    w_store = HostStore(4 * total, alloc=host_buffers_for(dev))
    w_mgr = TierManager([w_store], Namespace("gpu", "gpu", io.layout), io, write_queue_bytes=2 * total)
    callers, landed = [], []
    for _ in range(args.reps):
        w_store.clear()
        if pin:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in range(n):
            w_mgr.save(toks[b], src_kv[b * per : (b + 1) * per], len(toks[b]), slots[b])
        callers.append(time.perf_counter() - t0)
        assert w_mgr.wait_writes(120)
        landed.append(time.perf_counter() - t0)
    assert w_mgr.counters.save_dropped == 0
    for b in range(n):  # what landed is what the synchronous path saved
        plan = w_mgr.find(toks[b] + [1], 0, len(toks[b]), 0)
        assert plan is not None and plan.pos == len(toks[b])
    t_caller, t_landed = statistics.median(callers), statistics.median(landed)
    res["shipped_writer"] = {
        "caller_s": t_caller,
        "landed_s": t_landed,
        "caller_gbps": moved_bytes / t_caller / 1e9,
        "landed_gbps": moved_bytes / t_landed / 1e9,
        "write_seconds_in_writer": w_mgr.counters.write_seconds,
    }

    # pinned batch: every part into one pinned buffer, non-blocking, one sync per direction
    parts = [p for s in slots for p in pool.slot_parts(s)]
    idx = torch.tensor(src_kv, device=dev)
    kv_src = torch.stack([b.index_select(0, idx) for b in kv], dim=1)  # the gather the IO does
    sizes = [p.numel() * p.element_size() for p in parts] + [kv_src.numel() * kv_src.element_size()]
    stage = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    flat = [p.reshape(-1).view(torch.uint8) for p in parts] + [kv_src.reshape(-1).view(torch.uint8)]
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)

    def save_b() -> None:
        for f, a, b in zip(flat, offs, offs[1:]):
            stage[a:b].copy_(f, non_blocking=True)

    def load_b() -> None:
        for f, a, b in zip(flat, offs, offs[1:]):
            f.copy_(stage[a:b], non_blocking=True)

    t_save_b, t_load_b = _wall(save_b, args.reps), _wall(load_b, args.reps)
    res["pinned_batch"] = {
        "save_s": t_save_b,
        "load_s": t_load_b,
        "save_gbps": total / t_save_b / 1e9,
        "load_gbps": total / t_load_b / 1e9,
    }
    link = res["link_gbps"]
    for k in ("shipped", "pinned_batch"):
        res[k]["save_fraction_of_link"] = res[k]["save_gbps"] / link["d2h_pinned"]
        res[k]["load_fraction_of_link"] = res[k]["load_gbps"] / link["h2d_pinned"]
    w = res["shipped_writer"]
    w["caller_fraction_of_link"] = w["caller_gbps"] / link["d2h_pinned"]
    w["landed_fraction_of_link"] = w["landed_gbps"] / link["d2h_pinned"]
    res["round_trip_exact"] = bool(ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_tier_moves.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
