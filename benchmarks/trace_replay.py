"""Trace replay: the real sglang-k3 cache tree against other systems' policies, in simulated time.

    python -m benchmarks.trace_replay --trace ../shared/data/mooncake_conversation_trace.jsonl \\
        --policies k3,upstream,vllm-align,marconi,oracle,fa-budget --budgets-gib 10,20,40,80 \\
        --model-config kimi-linear-48b --checkpoint-dtype int8 --out benchmarks/results/trace_replay

Every policy drives ``sglang_k3.cache.K3RadixTree`` (placement, eviction and lookup are the real
code; see ``benchmarks/policies/``). The trace becomes token sequences as described in
``benchmarks/trace/mooncake.py`` (turns see the previous turn's prompt and output; one symbol = 64
tokens; all counts reported in real tokens).

Time model (simple and the same for every policy): one prefill engine serves requests first come,
first served in arrival order. A request's prefill starts at ``max(arrival, engine free)``, looks up
the cache at that moment, and takes ``prefill_flops(hit, L) / rate`` seconds, with FLOPs from the
model config (KDA + MLA incl. its attention over the prefix + MoE) and ``--prefill-tflops``
effective. TTFT = queueing + prefill. Decode runs beside it (no interference) at
``--decode-ms-per-token``; when a request finishes, its prompt + output go into the cache. The
memory budget covers the cache's MLA KV and checkpoints (``benchmarks/policies/base.py``).

Output: ``DIR/results.json``, one record per (policy, budget): ``policy``, ``budget_gib``,
``hit_rate`` (reused prompt tokens / prompt tokens), ``oracle_fraction``, ``fa_budget_fraction``,
``prefill_tokens`` (prompt tokens computed), ``ttft_p50_s``, ``ttft_p90_s``, ``checkpoint_bytes``
(mean bytes of live checkpoints over the run, sampled after each request) and more; and
``DIR/hit_rate.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import sys
import time
from array import array
from heapq import heappop, heappush

GiB = 1 << 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "mooncake_conversation_trace.jsonl"))
DEFAULT_OUT = os.path.join("benchmarks", "results", "trace_replay")
DEFAULT_POLICIES = "k3,k3-alpha0,k3-fixed,upstream,upstream-int8,vllm-align,marconi,oracle,fa-budget"
DTYPES = ("int8", "bf16", "fp32")


def _pct(sorted_vals, q: float) -> float:
    if not sorted_vals:
        return 0.0
    k = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def replay(policy, trace, cfg, rate_flops: float, tpot_s: float, progress=None) -> dict:
    """Run one policy over the whole trace; returns the raw measurements."""
    cost = cfg.cost
    n = len(trace)
    engine_free = 0.0
    finishes: list = []
    ttft = array("d")
    compute = array("d")
    hit = mla = req = 0
    ckpt_sum = kv_sum = 0.0
    ckpt_peak = 0
    t0 = time.perf_counter()
    for i in range(n):
        arrival = trace.arrival_s[i]
        start = max(arrival, engine_free)
        while finishes and finishes[0][0] <= start:
            _, j, ctx = heappop(finishes)
            policy.finish(trace, j, ctx)
        adm = policy.admit(trace, i)
        L = trace.input_len[i]
        d = cost.prefill_flops(adm.hit_tokens, L) / rate_flops + adm.load_s
        engine_free = start + d
        ttft.append(engine_free - arrival)
        compute.append(d)
        heappush(finishes, (engine_free + trace.output_len[i] * tpot_s, i, adm.ctx))
        hit += adm.hit_tokens
        mla += adm.mla_tokens
        req += L
        kvb, ckb = policy.sample()
        ckpt_sum += ckb
        kv_sum += kvb
        ckpt_peak = max(ckpt_peak, ckb)
        if progress is not None and (i + 1) % 200 == 0:
            progress(200)
    while finishes:
        _, j, ctx = heappop(finishes)
        policy.finish(trace, j, ctx)
    if progress is not None:
        progress(n % 200)
    t_sorted, c_sorted = sorted(ttft), sorted(compute)
    return {
        "requests": n,
        "prompt_tokens": req,
        "hit_tokens": hit,
        "hit_rate": hit / req if req else 0.0,
        "kv_present_rate": mla / req if req else 0.0,
        "prefill_tokens": req - hit,
        "ttft_p50_s": _pct(t_sorted, 0.5),
        "ttft_p90_s": _pct(t_sorted, 0.9),
        "ttft_mean_s": sum(ttft) / n,
        "prefill_compute_p50_s": _pct(c_sorted, 0.5),
        "prefill_compute_p90_s": _pct(c_sorted, 0.9),
        "prefill_busy_fraction": sum(compute) / max(engine_free, 1e-9),
        "checkpoint_bytes": ckpt_sum / n,
        "checkpoint_bytes_peak": ckpt_peak,
        "kv_bytes_mean": kv_sum / n,
        "replay_wall_s": time.perf_counter() - t0,
        **policy.summary(),
    }


# ------------------------------------------------------------------ parallel driver
_G: dict = {}


def _init_worker(queue) -> None:
    _G["queue"] = queue


def _run_job(job):
    from benchmarks.policies import POLICIES

    name, budget_gib = job
    trace, cfg, args = _G["trace"], _G["cfg"], _G["args"]
    budget = None if budget_gib is None else budget_gib * GiB
    policy = POLICIES[name](cfg, budget)
    q = _G.get("queue")
    progress = (lambda k: q.put(k)) if q is not None else _G.get("progress")
    out = replay(policy, trace, cfg, args.prefill_tflops * 1e12, args.decode_ms_per_token / 1e3, progress)
    return name, budget_gib, out


def _jobs(policies: list, budgets: list) -> list:
    from benchmarks.policies import POLICIES

    jobs = []
    needed = list(policies)
    for ref in ("oracle", "fa-budget"):  # the fractions need both, even when not requested
        if ref not in needed:
            needed.append(ref)
    for p in needed:
        if POLICIES[p].budget_independent:
            jobs.append((p, None))
        else:
            jobs.extend((p, b) for b in budgets)
    # heaviest first (bigger budgets keep bigger trees) so two workers finish together
    jobs.sort(key=lambda j: -(j[1] if j[1] is not None else 1e9))
    return jobs


def run_all(args, trace, cfg) -> list:
    from tqdm import tqdm

    jobs = _jobs(args.policies, args.budgets)
    _G.update(trace=trace, cfg=cfg, args=args)
    total = len(jobs) * len(trace)
    results = []
    with tqdm(
        total=total,
        desc=f"replay {len(jobs)} runs x {len(trace)} requests",
        unit="req",
        file=sys.stderr,
        disable=args.no_progress,
        smoothing=0.05,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
    ) as bar:
        if args.jobs <= 1 or len(jobs) == 1:
            _G["progress"] = bar.update
            for job in jobs:
                results.append(_run_job(job))
        else:
            gc.freeze()  # the trace is read-only from here: keep it out of the workers' GC passes
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            with ctx.Pool(processes=min(args.jobs, len(jobs)), initializer=_init_worker, initargs=(q,)) as pool:
                pending = pool.map_async(_run_job, jobs, chunksize=1)
                while not pending.ready():
                    with contextlib.suppress(queue.Empty):
                        bar.update(q.get(timeout=0.2))
                results = pending.get()
                while not q.empty():
                    bar.update(q.get())
    return results


def build_records(args, results) -> list:
    raw = {(p, b): out for p, b, out in results}
    oracle = next(out for (p, _), out in raw.items() if p == "oracle")
    records = []
    for p in args.policies:
        for b in args.budgets:
            out = raw.get((p, b)) or raw.get((p, None))
            fa = raw[("fa-budget", b)]
            rec = {
                "policy": p,
                "budget_gib": b,
                "hit_rate": out["hit_rate"],
                "oracle_fraction": out["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else 0.0,
                "fa_budget_fraction": out["hit_rate"] / fa["hit_rate"] if fa["hit_rate"] else 0.0,
                "prefill_tokens": out["prefill_tokens"],
                "ttft_p50_s": out["ttft_p50_s"],
                "ttft_p90_s": out["ttft_p90_s"],
                "checkpoint_bytes": out["checkpoint_bytes"],
                "budget_independent": (p, None) in raw,
            }
            rec.update({k: v for k, v in out.items() if k not in rec})
            rec.update(
                model_config=args.model_config,
                checkpoint_dtype=args.checkpoint_dtype,
                baseline_state_dtype=args.baseline_state_dtype,
                state_dtype=(
                    args.checkpoint_dtype
                    if p in ("k3", "k3-fixed", "k3-alpha0", "k3-rules", "k3-eager", "marconi")
                    else "int8"
                    if p == "upstream-int8"
                    else args.baseline_state_dtype
                    if p in ("upstream", "upstream-hicache", "vllm-align")
                    else None
                ),
                prefill_tflops=args.prefill_tflops,
                decode_ms_per_token=args.decode_ms_per_token,
                chunked_prefill_size=args.chunked_prefill_size,
                symbol_tokens=args.symbol_tokens,
                evict_watermark=args.evict_watermark,
                host_budget_gib=args.host_budget_gib if p.startswith("k3") or p == "upstream-hicache" else 0,
                l3_budget_gib=args.l3_budget_gib if p.startswith("k3") else 0,
                tier_park_interval=_park_interval(args) if p.startswith("k3") else 0,
            )
            records.append(rec)
    return records


def _park_interval(args) -> int:
    """The park interval the k3 policies run with: the flag's, else the server's default; 0 without a tier."""
    from sglang_k3.config import K3Config

    if not (args.host_budget_gib or args.l3_budget_gib):
        return 0
    return K3Config.tier_park_interval if args.tier_park_interval is None else args.tier_park_interval


def plot(records, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {
        "oracle": dict(ls="--", color="black"),
        "fa-budget": dict(ls=":", color="gray", marker="s"),
        "k3": dict(marker="o", lw=3.5, alpha=0.75, zorder=1),
        "k3-fixed": dict(marker="o", ls="--", alpha=0.75),
        "marconi": dict(marker="^", ls="--", zorder=3),
    }
    for p in dict.fromkeys(r["policy"] for r in records):
        rs = sorted((r for r in records if r["policy"] == p), key=lambda r: r["budget_gib"])
        xs, ys = [r["budget_gib"] for r in rs], [r["hit_rate"] for r in rs]
        ax.plot(xs, ys, label=p, **styles.get(p, dict(marker="o")))
    budgets = sorted({r["budget_gib"] for r in records})
    if len(budgets) > 1 and budgets[0] > 0 and budgets[-1] / budgets[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:g}" for b in budgets])
    ax.set_xlabel("cache memory budget (GiB, MLA KV + checkpoints)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, max(0.05, max(r["hit_rate"] for r in records) * 1.1))
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ CLI
def _csv(s: str) -> list:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    from benchmarks.policies import POLICIES

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_replay",
        description=__doc__.split("\n\n")[0] + " Replays a Mooncake-format JSONL trace through each "
        "policy at each memory budget and writes DIR/results.json and DIR/hit_rate.png.",
        epilog="Policies: k3 (ours, exactly as launch_server ships it: the server's request "
        "lifecycle built from its default K3Config, int8 checkpoints and MLA KV in one "
        "unified budget cut into the server's blocks), k3-fixed (--k3-no-unified-memory: "
        "checkpoints in their own pool of --k3-checkpoint-slots, KV in the rest), k3-alpha0 (a tuned "
        "variant, not the default: --k3-eviction-alpha 0), upstream "
        "(SGLang 0.5.23 hybrid cache, its default fp32 states), upstream-int8 (the same with its "
        "opt-in --enable-int8-mamba-checkpoint: a separate int8 state pool of 2x its state slots, "
        "outside the budget), vllm-align (vLLM align mode: states at prefill chunk ends and decode "
        "block boundaries), marconi (branch points + last token, FLOP-aware eviction with alpha "
        "tuned by its bootstrap replay), oracle "
        "(KV-only, unlimited memory), fa-budget (KV-only LRU in the same budget). Each is documented "
        "in benchmarks/policies/<name>.py. oracle and fa-budget always run, since every record "
        "reports its fraction of both.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL: timestamp (ms), input_length, output_length, hash_ids "
        "(one per 512-token block). Default: %(default)s",
    )
    ap.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated, from: {', '.join(POLICIES)} (default: %(default)s)",
    )
    ap.add_argument(
        "--budgets-gib",
        default="10,20,40,80",
        help="comma-separated cache memory budgets in GiB (default: %(default)s)",
    )
    ap.add_argument(
        "--model-config",
        default="kimi-linear-48b",
        choices=["tiny", "kimi-linear-48b", "k3"],
        help="state sizes and FLOPs (sglang_k3.cache.cost_model presets; default: %(default)s)",
    )
    ap.add_argument(
        "--checkpoint-dtype",
        default="int8",
        choices=DTYPES,
        help="KDA recurrent-state dtype of k3 and marconi checkpoints (default: %(default)s)",
    )
    ap.add_argument(
        "--baseline-state-dtype",
        default="fp32",
        choices=DTYPES,
        help="state dtype of upstream and vllm-align, which store the model's native state (default: %(default)s)",
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument(
        "--prefill-tflops",
        type=float,
        default=400.0,
        help="effective prefill rate in TFLOP/s for modelled TTFT (default: %(default)s)",
    )
    ap.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=20.0,
        help="decode time per output token; sets when a turn's output enters the cache (default: %(default)s)",
    )
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="prefill chunk in tokens (chunk-end checkpoints; default: %(default)s)",
    )
    ap.add_argument(
        "--upstream-mamba-ratio",
        type=float,
        default=0.9,
        help="upstream's mamba_full_memory_ratio: its state pool gets ratio/(1+ratio) of "
        "the budget (default: %(default)s, SGLang's fallback)",
    )
    ap.add_argument(
        "--symbol-tokens",
        type=int,
        default=64,
        help="real tokens per simulated token; a divisor of 256 and multiple of 64 "
        "(default: %(default)s = the hit unit)",
    )
    ap.add_argument(
        "--evict-watermark",
        type=float,
        default=0.02,
        help="when a pool is over budget, evict down to (1 - this) x budget, for every policy (default: %(default)s)",
    )
    ap.add_argument(
        "--host-budget-gib",
        type=float,
        default=0.0,
        help="k3 policies: a host tier of this many GiB below the device budget, for evicted "
        "boundaries (0: off; default: %(default)s); upstream-hicache: SGLang's HiCache with these host "
        "bytes (policies/upstream_hicache.py). Other policies have none (policies/tiers.py)",
    )
    ap.add_argument(
        "--l3-budget-gib",
        type=float,
        default=0.0,
        help="k3 policies: a Mooncake (L3) tier of this many GiB (0: off; default: %(default)s)",
    )
    ap.add_argument(
        "--host-gbps",
        type=float,
        default=55.0,
        help="host-to-device GB/s for tier loads in the modelled TTFT (default: %(default)s, H200 pinned)",
    )
    ap.add_argument(
        "--l3-gbps",
        type=float,
        default=12.5,
        help="L3-to-device GB/s for tier loads (default: %(default)s, one 100 Gb/s NIC: an assumption)",
    )
    ap.add_argument(
        "--tier-park-interval",
        type=int,
        default=None,
        help="k3 policies with a tier: --k3-tier-park-interval, a prompt's state saved below the "
        "device every N tokens (a multiple of 64 and of --symbol-tokens; 0: off; default: the "
        "server's, K3Config.tier_park_interval)",
    )
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel worker processes (default: %(default)s)"
    )
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = ap.parse_args(argv)

    args.policies = list(dict.fromkeys(_csv(args.policies)))
    if not args.policies:
        ap.error("--policies is empty")
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policy {', '.join(map(repr, bad))}; choose from: {', '.join(POLICIES)}")
    try:
        args.budgets = sorted(dict.fromkeys(float(b) for b in _csv(args.budgets_gib)))
    except ValueError:
        ap.error(f"--budgets-gib must be comma-separated numbers, got {args.budgets_gib!r}")
    if not args.budgets or any(not math.isfinite(b) or b <= 0 for b in args.budgets):
        ap.error(f"--budgets-gib needs positive numbers, got {args.budgets_gib!r}")
    args.budgets = [int(b) if b.is_integer() else b for b in args.budgets]
    if args.prefill_tflops <= 0 or args.decode_ms_per_token < 0 or args.chunked_prefill_size < 64:
        ap.error("--prefill-tflops must be > 0, --decode-ms-per-token >= 0, --chunked-prefill-size >= 64")
    if args.symbol_tokens < 64 or args.symbol_tokens % 64 or 256 % args.symbol_tokens:
        ap.error("--symbol-tokens must be 64, 128 or 256")
    if args.upstream_mamba_ratio <= 0:
        ap.error("--upstream-mamba-ratio must be > 0")
    if not 0 <= args.evict_watermark < 0.5:
        ap.error("--evict-watermark must be in [0, 0.5)")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    for name in ("host_budget_gib", "l3_budget_gib"):
        if not (0 <= getattr(args, name) < float("inf")):
            ap.error(f"--{name.replace('_', '-')} must be a finite number >= 0")
    park = args.tier_park_interval
    if park is not None and (park < 0 or park % max(64, args.symbol_tokens)):
        ap.error("--tier-park-interval must be a multiple of 64 and of --symbol-tokens")
    if park and not (args.host_budget_gib or args.l3_budget_gib):
        ap.error("--tier-park-interval needs --host-budget-gib or --l3-budget-gib")
    if args.host_gbps <= 0 or args.l3_gbps <= 0:
        ap.error("--host-gbps and --l3-gbps must be > 0")
    if "upstream-hicache" in args.policies and not args.host_budget_gib:
        ap.error("upstream-hicache models SGLang's host tier: give it --host-budget-gib")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.policies import SimConfig
    from benchmarks.trace import TraceError, load_trace, to_symbolic
    from sglang_k3.cache import preset

    t0 = time.perf_counter()
    try:
        reqs = load_trace(args.trace, limit=args.limit)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trace = to_symbolic(reqs, unit=args.symbol_tokens)
    t_conv = time.perf_counter() - t0
    cfg = SimConfig(
        cost=preset(args.model_config),
        unit=args.symbol_tokens,
        checkpoint_dtype=args.checkpoint_dtype,
        baseline_state_dtype=args.baseline_state_dtype,
        chunked_prefill_size=args.chunked_prefill_size,
        upstream_mamba_ratio=args.upstream_mamba_ratio,
        evict_watermark=args.evict_watermark,
        host_budget_bytes=args.host_budget_gib * GiB,
        l3_budget_bytes=args.l3_budget_gib * GiB,
        host_gbps=args.host_gbps,
        l3_gbps=args.l3_gbps,
        tier_park_interval=args.tier_park_interval,
    )
    print(
        f"trace: {len(trace)} requests, {sum(trace.input_len):,} prompt tokens, "
        f"{sum(1 for p in trace.parent if p >= 0)} continue an earlier turn (converted in {t_conv:.1f}s)",
        file=sys.stderr,
    )
    results = run_all(args, trace, cfg)
    records = build_records(args, results)
    wall = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        trace=os.path.abspath(args.trace),
        requests=len(trace),
        wall_s=wall,
        jobs=args.jobs,
        cpus=os.cpu_count(),
        python=platform.python_version(),
        machine=platform.machine(),
    )
    for r in records:
        r["run"] = meta
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    title = (
        f"{os.path.basename(args.trace)} ({len(trace)} req), {args.model_config}, "
        f"ckpt {args.checkpoint_dtype}, baselines {args.baseline_state_dtype}"
    )
    plot(records, os.path.join(args.out, "hit_rate.png"), title)
    print(
        f"{'policy':<11} {'GiB':>5} {'hit':>6} {'/oracle':>7} {'/fa-bud':>7} {'TTFT p50':>9} {'p90':>8} {'ckpt GiB':>8}"
    )
    for r in records:
        print(
            f"{r['policy']:<11} {r['budget_gib']:>5g} {r['hit_rate']:>6.3f} {r['oracle_fraction']:>7.3f} "
            f"{r['fa_budget_fraction']:>7.3f} {r['ttft_p50_s']:>9.3f} {r['ttft_p90_s']:>8.3f} "
            f"{r['checkpoint_bytes'] / GiB:>8.2f}"
        )
    print(f"wrote {os.path.join(args.out, 'results.json')} and hit_rate.png in {wall:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
