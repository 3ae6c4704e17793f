"""The overlap scheduler's effect on the k3 server: ``python -m benchmarks.overlap_ab``.

Starts two servers with ``sglang_k3.launch_server``'s defaults (the k3 cache, int8 checkpoints,
unified memory), one as shipped (the overlap scheduler on) and one with
``--disable-overlap-schedule``, and runs the same multi-turn workload on each: ``--conversations``
chats at once (8 by default: 8 requests in flight), each turn extending the previous one, so the
cache hits too. The runs alternate between the servers (``--repeats`` rounds, the order flipped
each round, the cache flushed before each run) so drift on a shared machine falls on both.

Reports per server the output tokens/s, TTFT p50/p90, token hit rate and prefill tokens, and the
ratios overlap / no-overlap; checks that both servers return the same greedy tokens. Writes
OUT/results.json and OUT/overlap_ab.png (default ``benchmarks/results/overlap_ab``).

On CPU the forward runs in the scheduler's thread, so the overlap scheduler hides little; on a
GPU it hides the scheduler's CPU work behind the device forward, and the effect is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live.server import Server, ServerStartError  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "overlap_ab")
CONFIGS = {"overlap": [], "no_overlap": ["--disable-overlap-schedule"]}
METRICS = ("output_tok_per_s", "ttft_p50_s", "ttft_p90_s", "hit_rate", "prefill_tokens")
SCHEMA = "sglang_k3.overlap_ab/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--server-args", default="", help="extra flags for both servers, one shell-quoted string")
    wl.add_multiturn_args(p, conversations=8, turns=3, first_len=128, user_len=64, reply_len=48)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs both servers, order flipped")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="server logs (default: the system temp folder)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    wl.check_multiturn_args(p, args)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def mean_of(runs: list[dict]) -> dict:
    out = {}
    for m in METRICS:
        vals = [r[m] for r in runs if r.get(m) is not None]
        out[m] = statistics.fmean(vals) if vals else None
    return out


def plot(summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_per_s", "output tokens/s"), ("ttft_p50_s", "TTFT p50 (s)"), ("hit_rate", "token hit rate")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6))
    colors = {"overlap": "#1f77b4", "no_overlap": "#7f7f7f"}
    for ax, (metric, label) in zip(axes, panels):
        names = list(summary)
        ys = [summary[n]["mean"][metric] or 0.0 for n in names]
        runs = [[r[metric] for r in summary[n]["runs"] if r.get(metric) is not None] for n in names]
        bars = ax.bar(names, ys, color=[colors[n] for n in names])
        for i, pts in enumerate(runs):
            ax.scatter([i] * len(pts), pts, color="black", s=10, zorder=3)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.3f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from sglang_k3.model.tiny_build import default_model_path

    vocab = wl.vocabulary(default_model_path())
    t0 = time.perf_counter()
    servers: dict[str, Server] = {}
    try:
        for name, flags in CONFIGS.items():
            servers[name] = Server(name, [*shlex.split(args.server_args), *flags], log_dir=args.log_dir).launch()
        for s in servers.values():
            s.wait_healthy()
            print(f"server {s.name} healthy after {s.start_seconds:.0f}s ({s.log_path})", flush=True)
        runs: dict[str, list] = {n: [] for n in CONFIGS}
        outputs: dict[str, dict] = {}
        for r in range(args.repeats):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                s = servers[name]
                s.flush_cache()
                summary, outs = wl.run_multiturn(
                    s.url, name, vocab, verbose=not args.quiet, **wl.multiturn_kwargs(args)
                )
                runs[name].append({"round": r, **summary})
                outputs.setdefault(name, outs)
                print(
                    f"round {r} {name}: {summary['output_tok_per_s']:.2f} out tok/s, TTFT p50 "
                    f"{summary['ttft_p50_s']:.3f}s, hit {summary['hit_rate']:.3f}, errors {summary['errors']}",
                    flush=True,
                )
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s in servers.values():
            s.stop()
    summary = {n: {"runs": runs[n], "mean": mean_of(runs[n]), "command": " ".join(servers[n].command)} for n in CONFIGS}
    ratios = {}
    for m in METRICS:
        a, b = summary["overlap"]["mean"][m], summary["no_overlap"]["mean"][m]
        ratios[m] = (a / b) if a is not None and b else None
    a, b = outputs.get("overlap", {}), outputs.get("no_overlap", {})
    mismatches = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    errors = sum(r["errors"] for n in runs for r in runs[n])
    result = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(shlex.quote(x) for x in ["python", "-m", "benchmarks.overlap_ab", *(argv or sys.argv[1:])]),
        "runtime_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "git": git_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "quiet")},
        "servers": summary,
        "ratios_overlap_over_no_overlap": ratios,
        "greedy": {"compared": len(set(a) & set(b)), "mismatches": mismatches},
        "errors": errors,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(
        summary,
        os.path.join(args.out, "overlap_ab.png"),
        f"k3 server, {args.conversations} requests in flight: overlap scheduler on vs off "
        f"(mean of {args.repeats} rounds; dots = rounds)",
    )
    print(
        "overlap / no-overlap: "
        + ", ".join(f"{m} {v:.3f}" for m, v in ratios.items() if v is not None)
        + f"; greedy mismatches {len(mismatches)} of {result['greedy']['compared']}; errors {errors}"
    )
    print(f"wrote {args.out}/results.json and overlap_ab.png in {result['runtime_s']:.0f}s")
    return 3 if mismatches or errors else 0


if __name__ == "__main__":
    sys.exit(main())
