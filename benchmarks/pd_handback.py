"""Prefill/decode disaggregation with and without the turn handed back: ``python -m benchmarks.pd_handback``.

The same multi-turn workload on three deployments of the embedded model, one after another:

* ``single``: one ``sglang_k3.launch_server`` with the k3 cache (no disaggregation);
* ``pd``: a disaggregated fleet (``LocalFleet`` with one prefill and one decode instance, what
  ``scripts/start_fleet.py --pd --no-shared-l3`` starts): the k3 cache on the prefill side only,
  so each turn's answer, generated on decode, is prefilled again by the next turn;
* ``pd_handback``: the same fleet with the shared Mooncake L3 (``start_fleet.py --pd``): decode
  writes each finished turn's boundary (state and answer KV) through to Mooncake and the next
  turn's prefill restores it.

Every server runs ``--server-args`` (default fp32 checkpoints, so all three must return the same
greedy tokens: mismatches against ``single`` are counted). The workload (``--conversations`` chats
taking turns one request at a time, each turn = previous prompt + the server's greedy reply + new
user tokens) is ``benchmarks.live.workloads.run_multiturn``, streamed through the router, so TTFT is
measured at the client. Reports per deployment the token hit rate (``cached_tokens`` over prompt
tokens), the prompt tokens computed, TTFT p50/p90, output tokens/s and, for the PD fleets, the
boundaries decode wrote and prefill loaded from the L3. Writes OUT/results.json, OUT/pd_handback.png
and OUT/README.md (default ``benchmarks/results/pd_handback``). Needs the Mooncake wheel (its
transfer engine carries the KV and states between the instances) and sglang-router.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live.report import bar_panel, write_report  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "pd_handback")
NAMES = ("single", "pd", "pd_handback")
# per PD instance with a k3 cache: the L3 traffic of the hand-back, and the unified budget (> 0: the
# instance runs unified memory, as every k3 server does by default)
TIER_STATS = (
    "tier_saves",
    "tier_l3_puts",
    "tier_l3_hits",
    "tier_l3_hit_tokens",
    "tier_loads",
    "tier_load_tokens",
    "memory_budget_bytes",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.pd_handback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wl.add_multiturn_args(p, conversations=4, turns=4, first_len=64, user_len=32, reply_len=32)
    p.add_argument(
        "--server-args",
        default="--k3-checkpoint-dtype fp32",
        help="launch_server flags for every server (default %(default)s: greedy tokens must match exactly)",
    )
    p.add_argument("--only", default=",".join(NAMES), help=f"comma-separated subset of {', '.join(NAMES)}")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default %(default)s)")
    p.add_argument("--log-dir", default=None, help="server and router logs (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    wl.check_multiturn_args(p, a)
    a.only = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in a.only if n not in NAMES]
    if bad or not a.only:
        p.error(f"--only: choose from {', '.join(NAMES)} (got {a.only})")
    return a


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _deployment(name: str, server_args: list[str], log_dir: str):
    """``name``'s deployment, started: yields (the URL to send to, the servers whose k3 counters
    to read). Stopped on exit."""
    from sglang_k3.fleet.instance import Server
    from sglang_k3.fleet.local_fleet import FleetSpec, LocalFleet

    if name == "single":
        srv = Server("single", server_args, log_dir=log_dir, log_prefix="pd_handback")
        try:
            yield srv.start().url, []
        finally:
            srv.stop()
        return
    spec = FleetSpec(
        prefill=1,
        decode=1,
        shared_l3=name == "pd_handback",
        policy="round_robin",
        instance_args=tuple(server_args),
        log_dir=log_dir,
    )
    with LocalFleet(spec, progress=_say) as fleet:
        yield fleet.url, fleet.instances


def _run_one(name: str, args, vocab: list[int], log_dir: str) -> tuple[dict, dict, dict]:
    """Start ``name``'s deployment, run the workload through it, stop it: (metrics, outputs, the
    PD instances' tier counters and unified budgets)."""
    from sglang_k3.fleet.instance import k3_state

    with _deployment(name, shlex.split(args.server_args), log_dir) as (url, instances):
        metrics, outputs = wl.run_multiturn(
            url, name, vocab, interleaved=True, verbose=not args.quiet, **wl.multiturn_kwargs(args)
        )
        tiers = {}
        for srv in instances:
            try:
                st = k3_state(srv.url)
            except KeyError:  # no k3 cache there (decode without the shared L3 runs none)
                continue
            tiers[srv.name] = {k: st.get(k, 0) for k in TIER_STATS}
        return metrics, outputs, tiers


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("hit_rate", "token hit rate"),
        ("prefill_tokens", "prompt tokens computed"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6))
    colors = {"single": "#7f7f7f", "pd": "#1f77b4", "pd_handback": "#2ca02c"}
    names = list(runs)
    for ax, (metric, label) in zip(axes, panels):
        bar_panel(ax, names, [runs[n]["metrics"][metric] or 0 for n in names], colors, label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(runs: dict) -> str:
    head = (
        "| deployment | hit rate | prompt tokens computed | TTFT p50 / p90 (s) | output tok/s "
        "| greedy mismatches vs single |"
    )
    rows = [head, "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        m = r["metrics"]
        mism = "-" if r["mismatches"] is None else f"{r['mismatches']} of {r['compared']}"
        rows.append(
            f"| {name} | {m['hit_rate']:.3f} | {m['prefill_tokens']:,} | {m['ttft_p50_s']:.2f} / {m['ttft_p90_s']:.2f} "
            f"| {m['output_tok_per_s']:.1f} | {mism} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    from sglang_k3.model.tiny_build import default_model_path

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pd_handback_")
    os.makedirs(args.out, exist_ok=True)
    vocab = wl.vocabulary(default_model_path())
    t0 = time.time()
    runs: dict = {}
    reference = None
    for name in args.only:
        _say(f"pd_handback: {name} ...")
        metrics, outputs, tiers = _run_one(name, args, vocab, log_dir)
        if name == "single":
            reference = outputs
        compared = mismatches = None
        if reference is not None and name != "single":
            keys = sorted(set(reference) & set(outputs))
            compared, mismatches = len(keys), sum(reference[k] != outputs[k] for k in keys)
        runs[name] = {"metrics": metrics, "tiers": tiers, "compared": compared, "mismatches": mismatches}
        _say(f"pd_handback: {name}: hit rate {metrics['hit_rate']:.3f}, {metrics['prefill_tokens']:,} computed")
    result = {
        "workload": wl.multiturn_kwargs(args) | {"interleaved": True},
        "server_args": args.server_args,
        "runs": runs,
        "wall_s": time.time() - t0,
        "git": git_info(),
        "machine": machine_info(),
    }
    w = result["workload"]
    title = (
        f"{w['conversations']} chats x {w['turns']} turns, {w['reply_len']}-token replies, "
        f"one request at a time ({args.server_args})"
    )
    plot(runs, os.path.join(args.out, "pd_handback.png"), title)
    write_report(
        args.out, "pd_handback", result, "Prefill/decode disaggregation: the turn handed back", title, _table(runs)
    )
    print(_table(runs))
    _say(f"wrote {args.out}/results.json, pd_handback.png and README.md ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
