"""Live A/B of the k3 radix cache against SGLang's own hybrid cache: ``python -m benchmarks.live_ab``.

Starts two real servers from this repo (``python -m sglang_k3.launch_server``), identical except
``--radix-cache-backend k3`` vs ``--radix-cache-backend upstream``, each at ``launch_server``'s
defaults (upstream: SGLang's own resolution, ``extra_buffer`` with the overlap scheduler on;
``--upstream-server-args "--mamba-radix-cache-strategy no_buffer"`` gives the ``no_buffer``
baseline, overlap off), and drives both with the same
workloads, one server at a time (the other sits idle with ``--sleep-on-idle``), flushing the cache
before each workload:

1. ``gsp``: SGLang's own ``python -m sglang.bench_serving --dataset-name generated-shared-prefix``
   (``--gsp-driver native``, and by default where ``bench_serving`` cannot import, e.g. on the GPU
   wheel set: the same shape sent by this project's client, greedy ids compared);
2. ``multiturn``: concurrent conversations whose every turn extends the previous one
   (prompt = previous prompt + the server's greedy reply + new user tokens);
3. ``trace``: a scaled slice of a Mooncake trace replayed with real token ids (the hash-id -> token
   rules of ``benchmarks/trace/mooncake.py``; a next turn sees the previous turn's real reply).

Per (workload, cache): TTFT p50/p90 (client-side, to the first streamed token), output tokens/s
(output tokens / wall time of the workload), token hit rate (sum ``meta_info.cached_tokens`` / sum
prompt tokens), prefill tokens computed (prompt - cached), and k3/upstream ratios. Greedy outputs of
the two servers are compared request by request on ``multiturn`` and ``trace`` (and, as text, on
``gsp``). Writes ``OUT/results.json`` and ``OUT/live_ab.png``.

``--pressure``: both servers get the same small byte budget (``PRESSURE_BUDGET``: SGLang's own
sizing flags, so k3's unified budget and upstream's KV + state pools hold the same bytes), about a
quarter of what the workloads' distinct prefixes need, and the workloads are sized up to cycle the
cache (``PRESSURE_SIZES``, for every size flag left at its default). A third server, upstream with
``--enable-unified-memory``, is tried and its start failure (if any) recorded. The JSON records each
server's exact command line, the peak of running requests (``sglang:num_running_reqs``) and k3's
memory split after each workload. Writes ``benchmarks/results/live_ab_pressure/`` by default.

Exit status: 0 ok; 1 a server or workload failed; 2 every selected workload was skipped; 3 the run
finished but greedy outputs differ
between the caches or requests failed (see ``greedy`` / ``errors`` in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "mooncake_conversation_trace.jsonl"))
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "live_ab")
PRESSURE_OUT = os.path.join(REPO, "benchmarks", "results", "live_ab_pressure")
# The same bytes for both caches, sized by SGLang's own flags: 1,536 KV tokens + 12 state slots
# (about 7.8 MB on the embedded model), at most 4 requests running. --enable-metrics exports the
# running-request gauge the peak is read from.
PRESSURE_TOTAL_TOKENS = 1536
PRESSURE_BUDGET = (
    f"--max-total-tokens {PRESSURE_TOTAL_TOKENS} --max-mamba-cache-size 12 --max-running-requests 4 --enable-metrics"
)
# The longest request the pressure budget's servers take (SGLang refuses a prompt within a few
# tokens of --max-total-tokens): trace conversations with a longer turn are left out of the slice.
PRESSURE_CONTEXT = PRESSURE_TOTAL_TOKENS - 16
PRESSURE_SIZES = {
    "mt_conversations": 16,
    "gsp_groups": 6,
    "gsp_prompts_per_group": 4,
    "gsp_concurrency": 4,
    "trace_requests": 32,
    "trace_window": 3000,
}
DEFAULT_LOGS = os.path.join(REPO, "benchmarks", "results", "tmp", "live_ab_logs")
CACHES = ("k3", "upstream")  # the pair every run compares
KNOWN_CACHES = (*CACHES, "off")  # "off": --disable-radix-cache, the no-cache baseline (--caches)
WORKLOADS = ("gsp", "multiturn", "trace")
RATIO_METRICS = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "output_tok_per_s", "prefill_tokens")
SCHEMA = "sglang_k3.live_ab/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.live_ab",
        description=__doc__.split("\n\n")[0] + " Starts a k3 server and an upstream-cache server, runs the "
        "same workloads on each in turn, and writes OUT/results.json and OUT/live_ab.png. Default sizes "
        "take ~5-10 minutes on 2 CPU cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--model-path",
        default=None,
        help="model to serve (passed as --model-path to both servers); default: the embedded tiny "
        "model, sglang_k3.model.tiny_build.default_model_path()",
    )
    g.add_argument(
        "--extra-server-args",
        default="",
        help='extra flags for BOTH servers, one shell-quoted string, e.g. "--chunked-prefill-size 256"',
    )
    g.add_argument(
        "--k3-server-args",
        default="",
        help='extra flags for the k3 server only (e.g. "--k3-checkpoint-dtype fp32"); recorded in the JSON',
    )
    g.add_argument(
        "--upstream-server-args",
        default="",
        help="extra flags for the upstream server only (default none: SGLang's own default, extra_buffer "
        "with the overlap scheduler on; '--mamba-radix-cache-strategy no_buffer' for the no_buffer baseline)",
    )
    g.add_argument(
        "--caches",
        default=",".join(CACHES),
        help="servers to run, from k3,upstream,off (off: --disable-radix-cache, the no-cache baseline); "
        "k3 and upstream are required",
    )
    g.add_argument(
        "--greedy-informational",
        action="store_true",
        help="record greedy mismatches between the caches without failing the run (bf16 on a GPU, where "
        "two cache-off servers already disagree; benchmarks.noise_differential is the check there)",
    )
    g.add_argument(
        "--time-cache",
        action="store_true",
        help="measure each cache's CPU time per scheduling step inside its server (benchmarks/live/cache_timing.py: "
        "every public method of the scheduler's tree_cache, outermost calls, thread CPU time, over run_batch calls); "
        "recorded per workload as cache_time",
    )
    g.add_argument(
        "--profile-cache",
        action="store_true",
        help="with --time-cache: also run cProfile over each server's whole scheduler from its start and write its "
        "tables beside the timing files (LOG_DIR/cache_timing_CACHE_PID/scheduler_PID_profile.txt), and each "
        "workload's own share, the difference of snapshots taken before and after it "
        "(scheduler_PID.WORKLOAD_profile.txt, from scheduler_PID.before_WORKLOAD.prof and .after_WORKLOAD.prof); it "
        "slows the scheduler, so the times of such a run are not the server's",
    )
    g.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    g.add_argument(
        "--out",
        default=None,
        help="output folder for results.json and live_ab.png (default: "
        "benchmarks/results/live_ab, or live_ab_pressure with --pressure)",
    )
    g.add_argument("--log-dir", default=DEFAULT_LOGS, help="server and bench_serving logs (git-ignored by default)")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    g.add_argument("--seed", type=int, default=1, help="seed of the synthetic prompts (same for both caches)")
    g.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    g.add_argument(
        "--warm-pass",
        action="store_true",
        help="before the measured workloads, each server answers each selected synthetic workload (gsp, multiturn; "
        "multiturn when only the trace is selected) once with other prompts (seed + 1000) and its cache is flushed: "
        "a fresh GPU server compiles and first-launches its Triton kernels for those prompt shapes then, not inside "
        "the measured pass (GPU_NOTES.md, ninth session). A lower tier keeps what the warm pass saved; nothing of "
        "it matches the measured prompts",
    )
    g.add_argument(
        "--pressure",
        action="store_true",
        help="memory-pressure mode: both servers get the same small budget (" + PRESSURE_BUDGET + "), "
        "workload sizes not given explicitly become "
        + ", ".join(f"{k}={v}" for k, v in PRESSURE_SIZES.items())
        + "; upstream with --enable-unified-memory is tried as a third server; default --out "
        "benchmarks/results/live_ab_pressure",
    )

    g = p.add_argument_group("gsp: sglang.bench_serving --dataset-name generated-shared-prefix")
    g.add_argument("--gsp-groups", type=int, default=2, help="--gsp-num-groups (distinct shared system prompts)")
    g.add_argument("--gsp-prompts-per-group", type=int, default=4, help="--gsp-prompts-per-group")
    g.add_argument("--gsp-system-len", type=int, default=384, help="--gsp-system-prompt-len (tokens)")
    g.add_argument("--gsp-question-len", type=int, default=32, help="--gsp-question-len (tokens)")
    g.add_argument("--gsp-output-len", type=int, default=8, help="--gsp-output-len (tokens)")
    g.add_argument("--gsp-concurrency", type=int, default=2, help="bench_serving --max-concurrency")
    g.add_argument(
        "--gsp-driver",
        choices=("auto", "bench_serving", "native"),
        default="auto",
        help="who sends the gsp requests: SGLang's bench_serving, or this project's client "
        "(benchmarks.live.workloads.run_gsp_native: the same shape, greedy ids compared); auto: "
        "bench_serving where it imports (it needs Hugging Face datasets, which the GPU wheel set lacks)",
    )

    g = p.add_argument_group("multiturn: concurrent conversations, each turn extends the previous one")
    g.add_argument("--mt-conversations", type=int, default=3, help="concurrent conversations")
    g.add_argument("--mt-turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--mt-system-len", type=int, default=128, help="system prompt tokens shared by all conversations")
    g.add_argument("--mt-first-len", type=int, default=128, help="user tokens of the first turn")
    g.add_argument("--mt-user-len", type=int, default=48, help="new user tokens per later turn")
    g.add_argument("--mt-reply-len", type=int, default=8, help="greedy reply tokens per turn (max_new_tokens)")
    g.add_argument(
        "--mt-branches",
        type=int,
        default=1,
        help="continuations of each conversation from turn --mt-fork-at on, one after another (1: no fork)",
    )
    g.add_argument("--mt-fork-at", type=int, default=0, help="the turn the branches fork at (0-based)")
    g.add_argument(
        "--mt-system-prompts",
        type=int,
        default=1,
        help="distinct system prompts; conversation c starts from prompt c mod this",
    )
    g.add_argument(
        "--mt-interleaved",
        action="store_true",
        help="one request at a time, the conversations taking turns (each one's next turn after all "
        "the others'), instead of all conversations at once",
    )

    g = p.add_argument_group("trace: a scaled slice of a Mooncake trace with real token ids")
    g.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake JSONL trace; the workload is skipped with a message when the file is missing",
    )
    g.add_argument("--trace-requests", type=int, default=8, help="requests in the slice")
    g.add_argument(
        "--trace-window",
        type=int,
        default=1000,
        help="take the slice's multi-turn conversations from the first N trace requests",
    )
    g.add_argument(
        "--trace-scale",
        type=int,
        default=32,
        help="divide input lengths, output lengths and the 512-token hash block by this (must divide 512)",
    )
    g.add_argument("--trace-max-output", type=int, default=16, help="cap on scaled output lengths (tokens)")
    g.add_argument("--trace-concurrency", type=int, default=4, help="requests in flight at once")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if any(c not in KNOWN_CACHES for c in args.caches) or not set(CACHES) <= set(args.caches):
        p.error(f"--caches: choose from {','.join(KNOWN_CACHES)}, with k3 and upstream; got {args.caches}")
    if args.profile_cache and not args.time_cache:
        p.error("--profile-cache runs with the cache timing: add --time-cache")
    if args.out is None:
        args.out = PRESSURE_OUT if args.pressure else DEFAULT_OUT
    if args.pressure:
        for name, value in PRESSURE_SIZES.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        p.error(f"--workloads: unknown {bad}; choose from {','.join(WORKLOADS)}")
    for name in (
        "gsp_groups",
        "gsp_prompts_per_group",
        "gsp_concurrency",
        "mt_conversations",
        "mt_turns",
        "mt_reply_len",
        "trace_requests",
        "trace_window",
        "trace_scale",
        "trace_max_output",
        "trace_concurrency",
        "gsp_output_len",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if 512 % args.trace_scale:
        p.error("--trace-scale must divide 512 (1, 2, 4, ..., 512)")
    if args.mt_system_len + args.mt_first_len < 1:
        p.error("--mt-system-len + --mt-first-len must be >= 1")
    if args.mt_system_prompts < 1:
        p.error("--mt-system-prompts must be >= 1")
    if args.mt_branches < 1:
        p.error("--mt-branches must be >= 1")
    if args.mt_branches > 1 and not 0 < args.mt_fork_at < args.mt_turns:
        p.error("--mt-fork-at must lie inside the conversation (1 .. --mt-turns - 1) with --mt-branches > 1")
    return args


# ----------------------------------------------------------------------------- results
def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def compute_ratios(records: list) -> list:
    """k3/upstream per workload and metric, from the records' own numbers (and k3/off and
    upstream/off, under ``against``, where a cache-off server ran)."""
    by = {(r["workload"], r["cache"]): r for r in records}
    out = []
    for w in dict.fromkeys(r["workload"] for r in records):
        k, u, o = by.get((w, "k3")), by.get((w, "upstream")), by.get((w, "off"))
        if k is None or u is None:
            continue
        row = {"workload": w, **{m: ratio(k[m], u[m]) for m in RATIO_METRICS}}
        if o is not None:
            row["against_off"] = {
                c: {m: ratio(r[m], o[m]) for m in RATIO_METRICS if m != "hit_rate"}
                for c, r in (("k3", k), ("upstream", u))
            }
        out.append(row)
    return out


def compare_outputs(a: dict, b: dict) -> dict:
    """Request-by-request greedy comparison of two caches' outputs."""
    keys = sorted(set(a) & set(b))
    details = []
    for k in keys:
        x, y = a[k], b[k]
        if x != y:
            first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            details.append({"request": k, "first_diff": first, "k3_len": len(x), "upstream_len": len(y)})
    return {"compared": len(keys), "mismatches": len(details), "missing": len(set(a) ^ set(b)), "details": details[:20]}


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(AttributeError):  # not on every OS
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    try:
        import sglang
        import torch

        info["sglang"], info["torch"] = sglang.__version__, torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def git_info() -> dict:
    def run(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            return None

    dirty = run("status", "--porcelain", "--", "sglang_k3", "kernels", "patches", "setup.py")
    return {
        "commit": (run("rev-parse", "HEAD") or "").strip() or None,
        "uncommitted_server_code": [ln[3:] for ln in dirty.splitlines()] if dirty else [],
    }


def fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(records: list, ratios: list, greedy: dict) -> None:
    by = {(r["workload"], r["cache"]): r for r in records}
    rat = {r["workload"]: r for r in ratios}
    print("\nworkload   cache     hit rate  TTFT p50  TTFT p90   out tok/s  prefill tok  errors")
    for w in dict.fromkeys(r["workload"] for r in records):
        for c in KNOWN_CACHES:
            r = by.get((w, c))
            if r:
                print(
                    f"{w:<10} {c:<9} {fmt(r['hit_rate']):>8} {fmt(r['ttft_p50_s']):>9} {fmt(r['ttft_p90_s']):>9} "
                    f"{fmt(r['output_tok_per_s'], '.2f'):>11} {r['prefill_tokens']:>12} {r['errors']:>7}"
                )
        if w in rat:
            q = rat[w]
            print(
                f"{w:<10} {'k3/up':<9} {fmt(q['hit_rate'], '.2f'):>8} {fmt(q['ttft_p50_s'], '.2f'):>9} "
                f"{fmt(q['ttft_p90_s'], '.2f'):>9} {fmt(q['output_tok_per_s'], '.2f'):>11} "
                f"{fmt(q['prefill_tokens'], '.2f'):>12}"
            )
    for r in records:
        t = r.get("cache_time")
        if t and t["cache_cpu_ms_per_step"] is not None:
            print(
                f"cache CPU time {r['workload']:<10} {r['cache']:<9} {t['cache_cpu_ms_per_step']:.3f} ms/step over "
                f"{t['steps']} steps ({t['cache_calls']} calls)"
            )
    for w, g in greedy.items():
        for c, x in g.get("against_off", {}).items():
            print(f"greedy {w}: {c} against cache off: {x['mismatches']} mismatches of {x['compared']}")
        print(
            f"greedy {w}: {g['mismatches']} mismatches of {g['compared']} requests compared"
            + (f", {g['missing']} missing on one side" if g["missing"] else "")
        )


def plot(records: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in records))
    by = {(r["workload"], r["cache"]): r for r in records}
    panels = [
        ("hit_rate", "token hit rate"),
        ("ttft_p50_s", "TTFT p50 (s); whisker = p90"),
        ("output_tok_per_s", "output tokens/s"),
        ("prefill_tokens", "prefill tokens computed"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    caches = [c for c in KNOWN_CACHES if any(r["cache"] == c for r in records)]
    width = 0.8 / len(caches)
    colors = {"k3": "#1f77b4", "upstream": "#ff7f0e", "off": "#7f7f7f"}
    for ax, (metric, label) in zip(axes, panels):
        for j, c in enumerate(caches):
            xs, ys, err = [], [], []
            for i, w in enumerate(workloads):
                r = by.get((w, c))
                if r is None or r[metric] is None:
                    continue
                xs.append(i + (j - (len(caches) - 1) / 2) * width)
                ys.append(r[metric])
                if metric == "ttft_p50_s":
                    err.append(max(0.0, (r["ttft_p90_s"] or r[metric]) - r[metric]))
            bars = ax.bar(
                xs, ys, width, label=c, color=colors[c], yerr=[[0] * len(err), err] if err else None, capsize=3
            )
            for b, y in zip(bars, ys):
                label = f"{y:.2f}" if metric != "prefill_tokens" else f"{int(y)}"
                ax.annotate(label, (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads)
        ax.set_title(label, fontsize=10)
        if metric == "hit_rate":
            ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- run
def server_args(args, cache: str) -> list:
    base = (["--model-path", args.model_path] if args.model_path else []) + shlex.split(args.extra_server_args)
    if args.pressure:
        base += shlex.split(PRESSURE_BUDGET)
    if cache == "upstream-unified":
        return [*base, "--radix-cache-backend", "upstream", "--enable-unified-memory"]
    if cache == "off":
        return [*base, "--disable-radix-cache"]
    own = shlex.split(args.k3_server_args if cache == "k3" else args.upstream_server_args)
    return [*base, "--radix-cache-backend", cache, *own]


def try_upstream_unified(args, Server, ServerStartError, log_dir: str, say) -> dict:
    """Start upstream with --enable-unified-memory under the same budget; on a CPU it refuses to
    start. Returns what happened (the command, and the error lines of its log)."""
    srv = Server(
        "upstream-unified",
        server_args(args, "upstream-unified"),
        start_timeout=args.start_timeout,
        log_dir=log_dir,
        log_prefix="live_ab",
    )
    out = {"command": shlex.join(srv.command)}
    try:
        srv.start()
        out["started"] = True
        say("  upstream --enable-unified-memory started (not compared: the A/B pair is k3 vs upstream)")
    except ServerStartError:
        tail = srv.log_tail(200, 600)
        lines = [ln for ln in tail.splitlines() if "Error" in ln or "refuse" in ln or "Out-of-tree" in ln]
        out.update(started=False, error=lines[-3:] if lines else tail.splitlines()[-3:])
        say(f"  upstream --enable-unified-memory did not start: {out['error'][-1] if out['error'] else '?'}")
    finally:
        srv.stop()
    return out


def k3_memory(url: str) -> dict:
    """The k3 server's unified-memory split, its lower tiers' counters (the memory_* and tier_*
    fields of /server_info) and its page counters (:data:`PAGE_COUNTERS`): on CUDA the
    tier_host_pin_* counters say whether the host tier's buffers were page-locked, and whether a
    freed range was still registered (issue 32)."""
    import requests

    st = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0].get("k3_cache", {})
    return {k: v for k, v in st.items() if k.startswith(("memory_", "tier_")) or k in PAGE_COUNTERS}


# with pages over one token: restores that copied a partial page out (``kv_page_copies``) and running
# requests' states not stored for want of a key inside their last page (``unkeyed_state_skips``)
PAGE_COUNTERS = ("kv_page_copies", "unkeyed_state_skips")


WARM_PASS_SEED_OFFSET = 1000  # --warm-pass: its prompts share nothing with the measured ones


def warm_up(srv, vocab: list) -> None:
    """Two short requests so first-request costs (lazy init, allocator growth) do not land in a
    workload, then a flush."""
    for n in (96, 160):
        srv.generate([vocab[(i * 7) % len(vocab)] for i in range(n)], 2)
    srv.flush_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    import signal

    # a `timeout` or Ctrl-C from a driver stops the servers this run started on the way out (the
    # finally below), not only the harness: servers left behind hold GPU memory for the next run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    sys.path.insert(0, REPO)
    from benchmarks.live import workloads as wl
    from benchmarks.live.running import RunningPeak
    from benchmarks.live.server import Server, ServerStartError
    from benchmarks.trace.mooncake import TraceError

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    os.makedirs(args.out, exist_ok=True)
    log_dir = args.log_dir
    if args.model_path:
        model_dir = args.model_path
    else:
        from sglang_k3.model.tiny_build import default_model_path

        model_dir = default_model_path()
    vocab = wl.vocabulary(model_dir)
    gsp_driver = args.gsp_driver
    if gsp_driver == "auto":
        gsp_driver = "bench_serving" if wl.bench_serving_runs() else "native"
    elif gsp_driver == "bench_serving" and "gsp" in args.workloads and not wl.bench_serving_runs():
        print(
            "error: --gsp-driver bench_serving: SGLang's bench_serving needs Hugging Face datasets "
            "(pip install datasets), or pass --gsp-driver native",
            file=sys.stderr,
        )
        return 2
    args.gsp_driver = gsp_driver  # recorded in the settings as the driver that ran
    skipped: dict = {}
    trace_slice = None
    if "trace" in args.workloads:
        if not os.path.exists(args.trace):
            skipped["trace"] = f"trace file not found: {args.trace} (pass --trace PATH)"
            print(f"SKIP trace workload: {skipped['trace']}", flush=True)
        else:
            try:
                trace_slice = wl.build_trace_slice(
                    args.trace,
                    requests_n=args.trace_requests,
                    window=args.trace_window,
                    scale=args.trace_scale,
                    max_output=args.trace_max_output,
                    max_context=PRESSURE_CONTEXT if args.pressure else None,
                )
            except (TraceError, ValueError) as e:
                print(f"error: trace workload: {e}", file=sys.stderr)
                return 1
            say(
                f"trace slice: {trace_slice.description['requests']} requests in "
                f"{trace_slice.description['conversations']} conversations; {trace_slice.description['rule']}"
            )
    workloads = [w for w in args.workloads if w not in skipped]
    if not workloads:
        print("nothing to run: every selected workload was skipped", file=sys.stderr)
        return 2

    def run_one(w, s, c, seed=None):
        seed = args.seed if seed is None else seed
        if w == "gsp":
            shape = dict(
                groups=args.gsp_groups,
                prompts_per_group=args.gsp_prompts_per_group,
                system_len=args.gsp_system_len,
                question_len=args.gsp_question_len,
                output_len=args.gsp_output_len,
                concurrency=args.gsp_concurrency,
                seed=seed,
                verbose=not args.quiet,
            )
            if gsp_driver == "native":
                return wl.run_gsp_native(s.url, c, vocab, **shape)
            return wl.run_bench_serving(s.url, c, model_dir, log_dir=log_dir, **shape)
        if w == "multiturn":
            return wl.run_multiturn(
                s.url,
                c,
                vocab,
                conversations=args.mt_conversations,
                turns=args.mt_turns,
                system_len=args.mt_system_len,
                first_len=args.mt_first_len,
                user_len=args.mt_user_len,
                reply_len=args.mt_reply_len,
                seed=seed,
                verbose=not args.quiet,
                branches=args.mt_branches,
                fork_at=args.mt_fork_at,
                system_prompts=args.mt_system_prompts,
                interleaved=args.mt_interleaved,
            )
        return wl.run_trace(s.url, c, trace_slice, vocab, concurrency=args.trace_concurrency, verbose=not args.quiet)

    upstream_unified = None
    if args.pressure:
        say("trying upstream with --enable-unified-memory under the same budget:")
        upstream_unified = try_upstream_unified(args, Server, ServerStartError, log_dir, say)
    timing_dirs = {c: os.path.join(log_dir, f"cache_timing_{c}_{os.getpid()}") for c in args.caches}

    def timing_env(c):
        if not args.time_cache:
            return None
        from benchmarks.live import cache_timing

        path = cache_timing.SITE_DIR + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        env = {"PYTHONPATH": path, cache_timing.ENV: timing_dirs[c]}
        if args.profile_cache:
            env[cache_timing.PROFILE_ENV] = "1"
        return env

    servers = {
        c: Server(
            c,
            server_args(args, c),
            start_timeout=args.start_timeout,
            log_dir=log_dir,
            log_prefix="live_ab",
            env=timing_env(c),
        )
        for c in args.caches
    }
    records, outputs = [], {c: {} for c in args.caches}
    failure = None  # a server or workload that failed after some workloads finished
    k3_split: dict = {}
    try:
        say("starting servers (both boot at once; 20-60 s each on a CPU):")
        for c, s in servers.items():
            say(f"  {c}: {shlex.join(s.command)}\n    log {s.log_path}")
            s.launch()
        for c, s in servers.items():
            s.wait_healthy()
            say(f"  {c} healthy after {s.start_seconds:.0f}s; warming up")
            warm_up(s, vocab)
        if args.warm_pass:
            warm = [w for w in workloads if w != "trace"] or ["multiturn"]  # the trace slice has no seed
            for c, s in servers.items():
                for w in warm:
                    say(f"  {c}: a warm pass of {w} with seed {args.seed + WARM_PASS_SEED_OFFSET} (not measured)")
                    run_one(w, s, c, seed=args.seed + WARM_PASS_SEED_OFFSET)
                s.flush_cache()
        for wi, w in enumerate(workloads):
            order = args.caches if wi % 2 == 0 else args.caches[::-1]  # alternate who goes first
            for c in order:
                s = servers[c]
                s.flush_cache()
                say(f"[{w}] on {c} ({s.url})")
                if args.time_cache:
                    from benchmarks.live import cache_timing

                    time.sleep(2 * cache_timing.WRITE_EVERY_S)  # the flush is in the snapshot
                    before = cache_timing.read(timing_dirs[c])
                    if args.profile_cache:  # the profile up to here, to subtract from the one after
                        time.sleep(cache_timing.PROFILE_EVERY_S + 0.5)
                        prof_before = cache_timing.snapshot_profiles(timing_dirs[c], f"before_{w}")
                t0 = time.time()
                peak = RunningPeak(s.url) if args.pressure else contextlib.nullcontext()
                with peak:
                    m, out = run_one(w, s, c)
                if args.time_cache:
                    time.sleep(2 * cache_timing.WRITE_EVERY_S)
                    m["cache_time"] = cache_timing.per_step(before, cache_timing.read(timing_dirs[c]))
                    if args.profile_cache:
                        time.sleep(cache_timing.PROFILE_EVERY_S + 0.5)
                        # kept beside the before_<w> copies: the profile a server rewrites at exit holds
                        # its idle time through the other servers' passes too
                        cache_timing.snapshot_profiles(timing_dirs[c], f"after_{w}")
                        for pb in prof_before:  # scheduler_<pid>.before_<w>.prof -> <pid>'s profile of <w> alone
                            pa = pb.replace(f".before_{w}.prof", f".after_{w}.prof")
                            with open(pb.replace(f".before_{w}.prof", f".{w}_profile.txt"), "w") as f:
                                f.write(cache_timing.profile_delta(pb, pa))
                if args.pressure:
                    m["running_peak"] = peak.peak
                if c == "k3":
                    k3_split[w] = k3_memory(s.url)
                if not s.alive():
                    raise RuntimeError(f"server {c} died during {w}:\n{s.log_tail()}")
                records.append({"workload": w, "cache": c, "order": order.index(c), **m})
                outputs[c].update(out)
                say(
                    f"[{w}] on {c}: {m['requests']} requests in {time.time() - t0:.0f}s, hit rate "
                    f"{fmt(m['hit_rate'])}, TTFT p50 {fmt(m['ttft_p50_s'])}s, "
                    f"{fmt(m['output_tok_per_s'], '.2f')} tok/s"
                )
    except (ServerStartError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        failure = str(e)[-2000:]
        if not records:
            return 1
        print("writing the workloads that finished before the failure", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()

    greedy = {}
    for w in dict.fromkeys(r["workload"] for r in records):
        pre = {"gsp": "gsp/", "multiturn": "conv", "trace": "trace/"}[w]
        g = compare_outputs(
            {k: v for k, v in outputs["k3"].items() if k.startswith(pre)},
            {k: v for k, v in outputs["upstream"].items() if k.startswith(pre)},
        )
        g["compares"] = (
            "generated text (bench_serving returns no ids)"
            if w == "gsp" and args.gsp_driver == "bench_serving"
            else "greedy output token ids"
        )
        if "off" in outputs:  # the cache-off server is the oracle both caches answer to
            off = {k: v for k, v in outputs["off"].items() if k.startswith(pre)}
            g["against_off"] = {
                c: compare_outputs({k: v for k, v in outputs[c].items() if k.startswith(pre)}, off)
                for c in ("k3", "upstream")
            }
        greedy[w] = g
    ratios = compute_ratios(records)
    runtime = time.time() - t_start
    result = {
        "schema": SCHEMA,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.live_ab " + shlex.join(sys.argv[1:] if argv is None else argv),
        "runtime_s": runtime,
        "machine": machine_info(),
        "git": git_info(),
        "settings": {
            "model": model_dir,
            "server_args": {c: servers[c].args for c in args.caches},
            "server_start_s": {c: servers[c].start_seconds for c in args.caches},
            "launch_server_cpu_defaults": "see docs/user_guide.md (device cpu, torch_native, --max-total-tokens 8192, "
            "--sleep-on-idle, ...)",
            "gsp": {k[4:]: v for k, v in vars(args).items() if k.startswith("gsp_")},
            "multiturn": {k[3:]: v for k, v in vars(args).items() if k.startswith("mt_")},
            "trace": (trace_slice.description | {"concurrency": args.trace_concurrency}) if trace_slice else None,
            "seed": args.seed,
            "warm_pass": args.warm_pass,
            "ttft": "client-side, request sent -> first streamed token"
            + (" (gsp: bench_serving's own TTFT)" if args.gsp_driver == "bench_serving" else ""),
            "output_tok_per_s": "output tokens of the workload / its wall time",
            "order": "one server at a time; the first cache alternates per workload (record field 'order')",
        },
        "skipped": skipped,
        "server_commands": {c: shlex.join(servers[c].command) for c in args.caches},
        "greedy_gates_exit": not args.greedy_informational,
        # the k3 server's memory_* and tier_* counters after each workload (with or without --pressure)
        "k3_cache_after_each_workload": k3_split,
        "pressure": None
        if not args.pressure
        else {
            "budget_flags": PRESSURE_BUDGET,
            "budget_bytes": next((v.get("memory_budget_bytes") for v in k3_split.values()), None),
            "sizes": PRESSURE_SIZES,
            "upstream_unified_memory": upstream_unified,
            "target": "k3 prefill tokens <= 0.7 x upstream's on multiturn and trace",
            "target_met": {
                r["workload"]: (r["prefill_tokens"] is not None and r["prefill_tokens"] <= 0.7)
                for r in ratios
                if r["workload"] in ("multiturn", "trace")
            },
        },
        "failure": failure,
        "records": records,
        "ratios": ratios,
        "greedy": greedy,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    if records:
        plot(
            records,
            os.path.join(args.out, "live_ab.png"),
            f"live A/B{' under memory pressure' if args.pressure else ''}, k3 vs upstream cache "
            f"({os.path.basename(model_dir.rstrip('/'))}, "
            f"{result['machine'].get('cpus_usable', '?')} CPUs, {time.strftime('%Y-%m-%d')})",
        )
    print_table(records, ratios, greedy)
    if args.pressure:
        print(f"running-request peaks: { {(r['workload'], r['cache']): r.get('running_peak') for r in records} }")
        print(f"target (k3 prefill <= 0.7 x upstream): {result['pressure']['target_met']}")
        if upstream_unified and not upstream_unified.get("started"):
            print(f"upstream --enable-unified-memory: did not start: {upstream_unified.get('error')}")
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and live_ab.png in {runtime:.0f}s", flush=True)
    if failure is not None:
        print(f"error: the run stopped early: {failure.splitlines()[0]}", file=sys.stderr)
        return 1

    def differs(g: dict) -> bool:
        pairs = [g, *g.get("against_off", {}).values()]
        return any(x["mismatches"] or x["missing"] for x in pairs)

    bad = [w for w in ("multiturn", "trace") if w in greedy and differs(greedy[w])]
    errs = sum(r["errors"] for r in records)
    if (bad and not args.greedy_informational) or errs:
        print(f"WARNING: greedy mismatches on {bad or 'none'}; {errs} failed requests", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
