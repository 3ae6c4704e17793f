"""Fleet trace replay: N k3 instances behind a modelled sglang-router, in simulated time, with and
without one shared L3 (Mooncake) tier, against one big instance with the fleet's memory.

    python -m benchmarks.fleet_replay --instances 3 --device-gib 40 --host-gib 200 --l3-gib 1024 \\
        --routings round_robin,cache_aware,session --out benchmarks/results/fleet_replay

Each instance is the replay's ``k3`` policy (``benchmarks/policies/k3.py``: the real tree and
lifecycle) configured as ``scripts/start_fleet.py`` ships it: with the shared L3,
``--k3-mooncake --k3-tier-write-policy write_through`` (a boundary reaches the L3 as soon as it is
stored); without it, the default ``write_back``. ``--host-gib`` is each instance's host tier
(``--k3-host-tier-gib``, which start_fleet passes through after ``--``). The routing models and
their sources are in ``benchmarks/fleet/routing.py``; the time model in ``benchmarks/fleet/sim.py``.

The reference (the "oracle" of the fleet) is one instance holding the whole fleet: N x the device
and host budgets, the same L3, and an engine N x as fast, so it carries the same load.

Output: ``DIR/results.json`` (one record per routing and L3 setting, plus ``single``), with
``hit_rate``, ``single_fraction`` (of the big instance's hit rate with the same L3 setting),
``best_routing_fraction`` (of the best routing's with the same L3 setting), hits per tier, TTFT
and the request share per instance; and ``DIR/hit_rate.png``. The target (issue: the fleet):
with the shared L3, every routing reaches at least 0.9 of the best routing's hit rate.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GiB = 1 << 30
DEFAULT_TRACE = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "mooncake_conversation_trace.jsonl"))
DEFAULT_OUT = os.path.join("benchmarks", "results", "fleet_replay")
SINGLE = "single"
TARGET_FRACTION = 0.9

_G: dict = {}


def _k3_config(args, l3: bool):
    from sglang_k3.config import K3Config

    return K3Config(checkpoint_dtype=args.checkpoint_dtype, tier_write_policy="write_through" if l3 else "write_back")


def _run_job(job):
    from benchmarks.fleet.routing import ROUTINGS
    from benchmarks.fleet.sim import replay_fleet
    from benchmarks.policies.k3 import K3Policy
    from benchmarks.policies.tiers import ModelledStore

    routing_name, l3 = job
    args, trace, cfg = _G["args"], _G["trace"], _G["cfg"]
    n = 1 if routing_name == SINGLE else args.instances
    scale = args.instances if routing_name == SINGLE else 1
    icfg = dataclasses.replace(cfg, host_budget_bytes=args.host_gib * GiB * scale, l3_budget_bytes=0)
    k3 = _k3_config(args, l3)
    shared = None
    if l3:
        shared = ModelledStore(
            int(args.l3_gib * GiB), "l3", icfg.kv_bytes_per_symbol, icfg.checkpoint_bytes(args.checkpoint_dtype)
        )
    policies = [K3Policy(icfg, args.device_gib * GiB * scale, k3, shared_l3=shared) for _ in range(n)]
    routing = ROUTINGS[routing_name](n) if n > 1 else None
    q = _G.get("queue")
    progress = (lambda k: q.put(k)) if q is not None else _G.get("progress")
    out = replay_fleet(
        policies, routing, trace, cfg.cost, args.prefill_tflops * 1e12 * scale, args.decode_ms_per_token / 1e3, progress
    )
    return routing_name, l3, out


def run_all(args, trace, cfg) -> list:
    from tqdm import tqdm

    l3s = [False, True] if args.l3_gib > 0 else [False]
    jobs = [(r, l3) for l3 in l3s for r in [SINGLE, *args.routings]]
    _G.update(args=args, trace=trace, cfg=cfg)
    with tqdm(
        total=len(jobs) * len(trace),
        desc=f"fleet replay {len(jobs)} runs x {len(trace)} requests",
        unit="req",
        file=sys.stderr,
        disable=args.no_progress,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
    ) as bar:
        if args.jobs <= 1:
            _G["progress"] = bar.update
            return [_run_job(j) for j in jobs]
        gc.freeze()
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        with ctx.Pool(processes=min(args.jobs, len(jobs)), initializer=_G.update, initargs=({"queue": q},)) as pool:
            pending = pool.map_async(_run_job, jobs, chunksize=1)
            while not pending.ready():
                with contextlib.suppress(queue.Empty):
                    bar.update(q.get(timeout=0.2))
            results = pending.get()
            while not q.empty():
                bar.update(q.get())
        return results


def build_records(args, results) -> list:
    records = []
    for l3 in sorted({r[1] for r in results}):
        mine = {name: out for name, l, out in results if l == l3}
        single = mine[SINGLE]["hit_rate"]
        best = max(out["hit_rate"] for name, out in mine.items() if name != SINGLE)
        for name, out in mine.items():
            records.append(
                {
                    "routing": name,
                    "shared_l3": l3,
                    "instances": 1 if name == SINGLE else args.instances,
                    "device_gib_per_instance": args.device_gib * (args.instances if name == SINGLE else 1),
                    "host_gib_per_instance": args.host_gib * (args.instances if name == SINGLE else 1),
                    "l3_gib": args.l3_gib if l3 else 0,
                    "single_fraction": out["hit_rate"] / single if single else 0.0,
                    "best_routing_fraction": None if name == SINGLE else (out["hit_rate"] / best if best else 0.0),
                    **out,
                }
            )
    return records


def plot(records, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["routing"] for r in records))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for j, l3 in enumerate(sorted({r["shared_l3"] for r in records})):
        vals = [next((r["hit_rate"] for r in records if r["routing"] == n and r["shared_l3"] == l3), 0) for n in names]
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        bars = ax.bar(xs, vals, width, label="shared L3" if l3 else "no L3")
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n if n != SINGLE else "one big instance" for n in names])
    ax.set_ylabel("token hit rate")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    from benchmarks.fleet.routing import ROUTINGS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL (default: the conversation trace)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--instances", type=int, default=3, help="instances in the fleet (default 3)")
    ap.add_argument("--device-gib", type=float, default=40.0, help="device cache budget per instance (default 40)")
    ap.add_argument("--host-gib", type=float, default=200.0, help="host tier per instance (default 200; 0 off)")
    ap.add_argument("--l3-gib", type=float, default=1024.0, help="the shared L3 (default 1024; 0: no L3 runs only)")
    ap.add_argument(
        "--routings",
        default=",".join(ROUTINGS),
        help=f"comma-separated, from: {', '.join(ROUTINGS)} (default: all)",
    )
    ap.add_argument("--model-config", default="kimi-linear-48b", choices=["tiny", "kimi-linear-48b", "k3"])
    ap.add_argument("--checkpoint-dtype", default="int8", choices=["int8", "bf16", "fp32"])
    ap.add_argument("--prefill-tflops", type=float, default=400.0, help="effective prefill rate per instance")
    ap.add_argument("--decode-ms-per-token", type=float, default=20.0)
    ap.add_argument("--host-gbps", type=float, default=55.0, help="host -> device (H200, pinned; GPU_NOTES)")
    ap.add_argument("--l3-gbps", type=float, default=12.5, help="L3 -> device (one 100 Gb/s NIC: an assumption)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel worker processes")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = ap.parse_args(argv)
    args.routings = list(dict.fromkeys(s.strip() for s in args.routings.split(",") if s.strip()))
    bad = [r for r in args.routings if r not in ROUTINGS]
    if bad or not args.routings:
        ap.error(f"--routings: unknown {bad}; choose from {', '.join(ROUTINGS)}")
    if args.instances < 2:
        ap.error("--instances must be >= 2 (a fleet)")
    if args.device_gib <= 0:
        ap.error("--device-gib must be > 0")
    if args.host_gib < 0 or args.l3_gib < 0:
        ap.error("--host-gib and --l3-gib must be >= 0")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.prefill_tflops <= 0 or args.decode_ms_per_token < 0 or args.host_gbps <= 0 or args.l3_gbps <= 0:
        ap.error("--prefill-tflops, --host-gbps and --l3-gbps must be > 0, --decode-ms-per-token >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.policies import SimConfig
    from benchmarks.trace import TraceError, load_trace, to_symbolic
    from sglang_k3.cache import preset

    t0 = time.perf_counter()
    try:
        reqs = load_trace(args.trace, limit=args.limit)
    except (TraceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trace = to_symbolic(reqs)
    cfg = SimConfig(
        cost=preset(args.model_config),
        checkpoint_dtype=args.checkpoint_dtype,
        host_gbps=args.host_gbps,
        l3_gbps=args.l3_gbps,
    )
    results = run_all(args, trace, cfg)
    records = build_records(args, results)
    wall = time.perf_counter() - t0
    meta = dict(trace=os.path.abspath(args.trace), requests=len(trace), wall_s=wall, cpus=os.cpu_count())
    meta["python"] = platform.python_version()
    for r in records:
        r["run"] = meta
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    title = (
        f"{os.path.basename(args.trace)} ({len(trace)} req), {args.instances} x ({args.device_gib:g} GiB device + "
        f"{args.host_gib:g} GiB host), L3 {args.l3_gib:g} GiB shared, {args.model_config}, {args.checkpoint_dtype}"
    )
    plot(records, os.path.join(args.out, "hit_rate.png"), title)
    head = ("routing", "L3", "hit", "/single", "/best", "host", "l3", "TTFT p50", "imbal")
    print(f"{head[0]:<12} " + " ".join(f"{h:>7}" for h in head[1:]))
    for r in records:
        bf = "-" if r["best_routing_fraction"] is None else f"{r['best_routing_fraction']:.3f}"
        req = r["prompt_tokens"] or 1
        cells = [
            "yes" if r["shared_l3"] else "no",
            f"{r['hit_rate']:.3f}",
            f"{r['single_fraction']:.3f}",
            bf,
            f"{r['host_hit_tokens'] / req:.3f}",
            f"{r['l3_hit_tokens'] / req:.3f}",
            f"{r['ttft_p50_s']:.3f}",
            f"{r['request_imbalance']:.2f}",
        ]
        print(f"{r['routing']:<12} " + " ".join(f"{c:>7}" for c in cells))
    with_l3 = [r for r in records if r["shared_l3"] and r["routing"] != SINGLE]
    if with_l3:
        worst = min(r["best_routing_fraction"] for r in with_l3)
        verdict = "met" if worst >= TARGET_FRACTION else "NOT met"
        print(f"target (shared L3: every routing >= {TARGET_FRACTION} of the best): {verdict}, worst {worst:.3f}")
    print(f"wrote {os.path.join(args.out, 'results.json')} and hit_rate.png in {wall:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
