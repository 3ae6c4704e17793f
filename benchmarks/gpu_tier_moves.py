"""GPU measurement of the lower tiers' moves at Kimi-Linear-48B dimensions (issue 13).

    python benchmarks/gpu_tier_moves.py --out DIR

A batch of INT8 checkpoints (48B: 20 KDA layers x 32 heads x 128 x 128 int8 + fp32 scales + conv
(3, 12288) bf16: 12.3 MB each) and MLA KV pages (7 layers x 576 bf16 = 8,064 B/token) on one H200,
moved device -> host -> device:

* ``shipped``: what ``--k3-host-tier-gib`` runs: the tier manager over a host store and the
  server's :class:`~sglang_k3.tiers.torch_io.PoolTierIO`, one boundary at a time (a checkpoint and
  the KV of its prefix, as 64-token block objects and a tail), saved, then found and loaded, with
  keys, hashing, the checked object format (checksums on the device) and the store included.
  Every object saved is then decoded once more with the checksum verified on the host (the
  numpy reference), so the device's checksums are checked against the reference here too. The store is cleared before
  each save: the first writes into fresh memory (``save_first_*``), the later ones into the spare
  buffers the clear left, as a full host tier's saves do (the median, ``save_*``);
* ``shipped_writer``: the same saves with the writer thread on (``--k3-tier-write-queue-mib``, the
  server's default): ``caller_s`` is what the saves take on the caller's (the scheduler's)
  thread (keys, lookups, and starting the read off the device into the new objects);
  ``landed_s`` until every write landed (the copies, sealing and puts, in the writer thread);
  into spare buffers, the first repetition (fresh memory) not counted;
* ``shipped_writer_batch``: the same with all the boundaries in one ``save_many`` call, as an
  eviction that demotes several boundaries hands them over (reads in groups of 256 MiB, each
  started as soon as it is planned: here one group);
* ``shipped_writer_sustained``: three such batches of new boundaries back to back, until all
  landed (one batch's planning overlaps the last one's copies). The writer sections run with the
  server's write-queue bound (``--write-queue-mib``): a save past it is dropped and counted
  (``saves_dropped``), and rates are over the bytes that landed;
* ``writer_batch_by_group_mib``: ``shipped_writer_batch`` again with other group sizes than the
  shipped ``TierManager.READ_GROUP_BYTES`` (``--group-sweep``): what the size trades, the
  caller's launches against the link's overlap with planning;
* ``pinned_batch``: the same bytes gathered into one pinned host buffer with non-blocking copies
  and one synchronisation per direction (what a batched tier IO would do);
* the link itself: one 256 MiB pinned copy each way, the reference every fraction is taken of.

Every round trip is checked byte for byte. Writes DIR/gpu_tier_moves.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from sglang_k3.config import K3Config
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


def _profile(fns: dict, out: str) -> None:
    """One call of each of ``fns`` under cProfile (with a device sync), the top entries by own
    time written to ``out/profile_NAME.txt``."""
    import cProfile
    import io
    import pstats

    os.makedirs(out, exist_ok=True)
    for name, fn in fns.items():
        prof = cProfile.Profile()
        prof.enable()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out, f"profile_{name}.txt"), "w") as f:
            f.write(buf.getvalue())


def plot(res: dict, path: str) -> None:
    """The fractions of the link each path reached, one bar each (``--plot DIR`` redraws it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        ("shipped save", res["shipped"]["save_fraction_of_link"]),
        ("shipped load", res["shipped"]["load_fraction_of_link"]),
        ("writer, a call\na boundary", res["shipped_writer"]["landed_fraction_of_link"]),
        ("writer, one\nbatch", res["shipped_writer_batch"]["landed_fraction_of_link"]),
        ("writer, batches\nback to back", res["shipped_writer_sustained"]["landed_fraction_of_link"]),
        ("one pinned copy\n(reference)", res["pinned_batch"]["save_fraction_of_link"]),
    ]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(range(len(bars)), [b for _, b in bars], color=["C0"] * 5 + ["gray"])
    ax.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=8)
    ax.axhline(0.8, color="black", lw=0.8, ls=":", label="target 0.8")
    ax.set_ylabel("fraction of the pinned link")
    b = res["batch"]
    ax.set_title(
        f"{res['device']}: {b['checkpoints']} int8 checkpoints + {b['kv_tokens']:,} KV tokens "
        f"({(b['state_bytes'] + b['kv_bytes']) / 1e6:.0f} MB)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", action="store_true", help="only redraw OUT/gpu_tier_moves.png from its JSON")
    ap.add_argument("--checkpoints", type=int, default=8, help="checkpoints per batch")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="MLA KV tokens per batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--write-queue-mib",
        type=int,
        default=K3Config.tier_write_queue_mib,
        help="the writer's bound on bytes in flight (default: the server's, --k3-tier-write-queue-mib)",
    )
    ap.add_argument(
        "--group-sweep",
        default="8,16,64,256",
        help="comma-separated group sizes (MiB) to run the one-batch writer section at besides the "
        "shipped TierManager.READ_GROUP_BYTES ('' for none)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also write where the host's time goes in one shipped save and load (cProfile)",
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="run on CPU (checks the script, measures nothing useful)")
    args = ap.parse_args()
    if args.plot:
        with open(os.path.join(args.out, "gpu_tier_moves.json")) as f:
            plot(json.load(f), os.path.join(args.out, "gpu_tier_moves.png"))
        return 0
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
    # the checksums the device computed are the reference's: every object checked on the host
    from sglang_k3.tiers import codec

    checked = 0
    for key in list(host_store._objects):
        codec.decode(key, host_store.get(key), io.kv_token_bytes, io.state_bytes, verify=True)
        checked += 1
    fresh = pool.alloc(n)

    def load() -> None:
        for b, s in enumerate(fresh):
            pool._sealed[s] = False  # re-load into the same slot each repetition
            plan = mgr.find(toks[b] + [1], 0, len(toks[b]), 0)
            assert plan is not None and plan.pos == len(toks[b])
            assert mgr.load(plan, dst_kv[b * per : b * per + plan.pos], s) is not None

    t_load = _wall(load, args.reps)
    if args.profile:

        def save_batch() -> None:
            host_store.clear()
            mgr.save_many([(toks[b], src_kv[b * per : (b + 1) * per], len(toks[b]), slots[b], 0) for b in range(n)])

        _profile({"save": save, "save_batch": save_batch, "load": load}, args.out)
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
        "objects_checked_on_host": checked,
        "host_buffers_pinned": host_store.stats().get("tier_host_pin_registered", 0),
        "host_buffers_pin_failures": host_store.stats().get("tier_host_pin_failures", 0),
        "save_gbps": moved_bytes / t_save / 1e9,
        "load_gbps": moved_bytes / t_load / 1e9,
    }

    # shipped, with the writer thread: the caller reads off the device, the writer seals and puts;
    # one boundary per call (write-through, parking), then all in one call (an eviction's batch)
    batch = [(toks[b], src_kv[b * per : (b + 1) * per], len(toks[b]), slots[b], 0) for b in range(n)]
    # the writer's queue bound is the server's (--write-queue-mib, --k3-tier-write-queue-mib's
    # default unless given): a save past it is dropped and counted, so the rates below are over
    # the bytes that landed
    queue = args.write_queue_mib << 20
    boundary_bytes = moved_bytes / n
    res["write_queue_bytes"] = queue

    def writer_section(one_call: bool, read_group_bytes: int = TierManager.READ_GROUP_BYTES) -> dict:
        """The saves of ``batch`` with the writer thread at the server's queue bound, one call per
        boundary or all in one call, ``reps`` times after one into fresh memory (not counted)."""
        w_store = HostStore(4 * total, alloc=host_buffers_for(dev))
        w_mgr = TierManager([w_store], Namespace("gpu", "gpu", io.layout), io, write_queue_bytes=queue)
        w_mgr.READ_GROUP_BYTES = read_group_bytes
        callers, landed, saved = [], [], []
        for _ in range(args.reps + 1):  # the first fills fresh memory (see save_first_s): not counted
            w_store.clear()
            if pin:
                torch.cuda.synchronize()
            before = w_mgr.counters.saves
            t0 = time.perf_counter()
            if one_call:
                w_mgr.save_many(batch)
            else:
                for b in batch:
                    w_mgr.save(*b)
            callers.append(time.perf_counter() - t0)
            assert w_mgr.wait_writes(120)
            landed.append(time.perf_counter() - t0)
            saved.append(w_mgr.counters.saves - before)
        for b in range(n):  # what landed is what the synchronous path saved
            plan = w_mgr.find(toks[b] + [1], 0, len(toks[b]), 0)
            assert plan is None or plan.pos == len(toks[b])
        t_caller, t_landed = statistics.median(callers[1:]), statistics.median(landed[1:])
        moved = statistics.median(saved[1:]) * boundary_bytes
        return {
            "caller_s": t_caller,
            "landed_s": t_landed,
            "saves_dropped": w_mgr.counters.save_dropped,
            "landed_bytes": moved,
            "caller_gbps": moved / t_caller / 1e9,
            "landed_gbps": moved / t_landed / 1e9,
            "write_seconds_in_writer": w_mgr.counters.write_seconds,
        }

    res["shipped_writer"] = writer_section(one_call=False)
    res["shipped_writer_batch"] = writer_section(one_call=True)

    # sustained: several batches of new boundaries saved back to back (an eviction each), until
    # all landed: the planning of one batch overlaps the copies of the one before
    rounds = 3
    s_store = HostStore((rounds + 1) * total, alloc=host_buffers_for(dev))
    s_mgr = TierManager([s_store], Namespace("gpu", "gpu", io.layout), io, write_queue_bytes=queue)
    s_toks = [
        [[(b * 7919 + i + 100_003 * (r + 1)) % 50000 for i in range(per - 7)] for b in range(n)]
        for r in range(rounds + 1)
    ]
    sustained = []
    for _ in range(2):  # the first pass fills fresh memory; the second is timed
        s_store.clear()
        if pin:
            torch.cuda.synchronize()
        before = s_mgr.counters.saves
        t0 = time.perf_counter()
        for r in range(rounds):
            s_mgr.save_many(
                [(s_toks[r][b], src_kv[b * per : (b + 1) * per], len(s_toks[r][b]), slots[b], 0) for b in range(n)]
            )
        assert s_mgr.wait_writes(120)
        sustained.append(time.perf_counter() - t0)
    moved = (s_mgr.counters.saves - before) * boundary_bytes
    res["shipped_writer_sustained"] = {
        "batches": rounds,
        "landed_s": sustained[-1],
        "saves_dropped": s_mgr.counters.save_dropped,
        "landed_bytes": moved,
        "landed_gbps": moved / sustained[-1] / 1e9,
    }

    # the one-batch section at other group sizes than the shipped one (TierManager.READ_GROUP_BYTES):
    # what the size trades, the caller's planning against the link, measured beside the default
    sizes_mib = [m.strip() for m in args.group_sweep.split(",") if m.strip()]
    sweep = {m: writer_section(True, int(m) << 20) for m in sizes_mib}
    res["shipped_writer_batch"]["read_group_bytes"] = TierManager.READ_GROUP_BYTES
    res["writer_batch_by_group_mib"] = sweep

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
    # the checksum kernel alone, over the same bytes as the objects of a batch (2 MB pieces)
    from sglang_k3.kernels.tier import device_checksums

    blob = torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev, generator=g)
    piece = 256 * io.kv_token_bytes
    offs_c = list(range(0, total, piece))
    sizes_c = [min(piece, total - o) for o in offs_c]
    t_sum = _wall(lambda: device_checksums(blob, offs_c, sizes_c)(), args.reps)
    res["checksum_kernel"] = {"pieces": len(offs_c), "s": t_sum, "gbps": total / t_sum / 1e9}
    link = res["link_gbps"]
    for k in ("shipped", "pinned_batch"):
        res[k]["save_fraction_of_link"] = res[k]["save_gbps"] / link["d2h_pinned"]
        res[k]["load_fraction_of_link"] = res[k]["load_gbps"] / link["h2d_pinned"]
    for w in (res["shipped_writer"], res["shipped_writer_batch"], *sweep.values()):
        w["caller_fraction_of_link"] = w["caller_gbps"] / link["d2h_pinned"]
        w["landed_fraction_of_link"] = w["landed_gbps"] / link["d2h_pinned"]
    w = res["shipped_writer_sustained"]
    w["landed_fraction_of_link"] = w["landed_gbps"] / link["d2h_pinned"]
    res["round_trip_exact"] = bool(ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_tier_moves.json"), "w") as f:
        json.dump(res, f, indent=1)
    with contextlib.suppress(ImportError):  # no matplotlib where it ran: --plot redraws it from the JSON
        plot(res, os.path.join(args.out, "gpu_tier_moves.png"))
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
