"""The lower tiers live, on CPU: ``python -m benchmarks.tier_ab``.

Starts a ``mooncake_master`` on free loopback ports and three ``sglang_k3.launch_server`` servers
with the k3 cache as shipped (int8 checkpoints, unified memory), all with the same device budget,
too small for the workload (``--device-args``, default 2,048 KV tokens, 8 state slots, 4 running
requests):

* ``device``: no lower tier (the default server);
* ``host``: ``--k3-host-tier-gib HOST`` (default 16 MiB: it overflows too, on purpose);
* ``host_mooncake``: the same host tier plus ``--k3-mooncake`` (this instance's segment
  ``--mooncake-segment-mib``, TCP on loopback).

The same multi-turn workload runs on each, one server at a time: ``--conversations`` chats at once,
each turn extending the previous one, so between two turns of a chat the others push its state
and KV off the device. Reports per server the token hit rate, prefill tokens, TTFT p50/p90, output
tokens/s and the boundaries each tier gave back, and the ratios against ``device``; compares the
greedy tokens with ``device``'s (exact with ``--server-args "--k3-checkpoint-dtype fp32"``; with
int8 a restore at another boundary may flip a near-tie, counted). Writes OUT/results.json and
OUT/tier_ab.png (default ``benchmarks/results/tier_ab``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live.server import Server, ServerStartError  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402
from sglang_k3.fleet.instance import k3_state  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "tier_ab")
DEVICE_ARGS = "--max-total-tokens 2048 --max-mamba-cache-size 8 --max-running-requests 4"
NAMES = ("device", "host", "host_mooncake")
METRICS = ("hit_rate", "prefill_tokens", "ttft_p50_s", "ttft_p90_s", "output_tok_per_s")
TIER_STATS = (
    "tier_loads",
    "tier_host_hits",
    "tier_l3_hits",
    "tier_load_tokens",
    "tier_saves",
    "tier_save_failures",
    "tier_invalid_objects",
    "tier_errors",
    "tier_host_evictions",
    "tier_l3_put_refused",
    "tier_find_seconds",
    "tier_load_seconds",
    "tier_save_seconds",
    "tier_save_dropped",
    "tier_writes_queued",
    "tier_write_seconds",
    "tier_prefetches",
    "tier_prefetch_hits",
    "tier_prefetch_lead_seconds",
    "tier_prefetch_failures",
    "tier_held",
    "tier_held_seconds",
    "tier_held_expired",
    "tier_hold_lookups",
    "tier_hold_waits",
    "evicted_checkpoints",
    "evicted_kv_tokens",
)
SCHEMA = "sglang_k3.tier_ab/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tier_ab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device-args", default=DEVICE_ARGS, help="the device budget, for all three (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra flags for all three servers, one shell-quoted string")
    p.add_argument(
        "--host-gib", type=float, default=0.015625, help="host tier GiB of host and host_mooncake (default 16 MiB)"
    )
    p.add_argument("--mooncake-segment-mib", type=int, default=1024, help="host_mooncake's Mooncake segment, MiB")
    wl.add_multiturn_args(p, conversations=16, turns=4, first_len=512, user_len=128, reply_len=32)
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="server and master logs (default: the system temp folder)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    wl.check_multiturn_args(p, args)
    if not (0 < args.host_gib < float("inf")):
        p.error("--host-gib must be a positive number")
    if args.mooncake_segment_mib < 16:
        p.error("--mooncake-segment-mib must be >= 16 (Mooncake's smallest segment that mounts)")
    return args


def plot(servers: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("hit_rate", "token hit rate"), ("prefill_tokens", "prefill tokens"), ("ttft_p50_s", "TTFT p50 (s)")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.0 * (len(panels) + 1), 3.6))
    colors = {"device": "#7f7f7f", "host": "#1f77b4", "host_mooncake": "#2ca02c"}
    names = list(servers)
    for ax, (metric, label) in zip(axes, panels):
        ys = [servers[n]["metrics"][metric] or 0 for n in names]
        bars = ax.bar(names, ys, color=[colors[n] for n in names])
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.3g}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    ax = axes[-1]
    host = [servers[n]["tiers"].get("tier_host_hits", 0) for n in names]
    l3 = [servers[n]["tiers"].get("tier_l3_hits", 0) for n in names]
    ax.bar(names, host, color="#1f77b4", label="from host")
    ax.bar(names, l3, bottom=host, color="#2ca02c", label="from Mooncake")
    ax.set_title("boundaries brought back", fontsize=10)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from sglang_k3.model.tiny_build import default_model_path
    from sglang_k3.tiers.mooncake_master import MooncakeMaster

    vocab = wl.vocabulary(default_model_path())
    t0 = time.perf_counter()
    base = [*shlex.split(args.device_args), *shlex.split(args.server_args)]
    host = ["--k3-host-tier-gib", str(args.host_gib)]
    flags = {"device": base, "host": [*base, *host], "host_mooncake": [*base, *host, "--k3-mooncake"]}
    log_dir = args.log_dir or tempfile.gettempdir()
    os.makedirs(log_dir, exist_ok=True)
    master = None
    servers: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    try:
        master = MooncakeMaster(log_path=os.path.join(log_dir, "tier_ab_mooncake_master.log")).start()
        env = master.client_env(args.mooncake_segment_mib << 20)
        for name in NAMES:
            srv = Server(name, flags[name], log_dir=args.log_dir, log_prefix="tier_ab", env=env).start()
            print(f"server {name} healthy after {srv.start_seconds:.0f}s ({srv.log_path})", flush=True)
            try:
                before = k3_state(srv.url)
                metrics, outs = wl.run_multiturn(
                    srv.url, name, vocab, verbose=not args.quiet, **wl.multiturn_kwargs(args)
                )
                after = k3_state(srv.url)
            finally:
                srv.stop()
            tiers = {k: after.get(k, 0) - before.get(k, 0) for k in TIER_STATS}
            servers[name] = {"command": " ".join(srv.command), "metrics": metrics, "tiers": tiers}
            outputs[name] = outs
            print(
                f"{name}: hit {metrics['hit_rate']:.3f}, prefill {metrics['prefill_tokens']} tokens, TTFT p50 "
                f"{metrics['ttft_p50_s']:.3f}s, host {tiers['tier_host_hits']} / Mooncake {tiers['tier_l3_hits']} "
                f"boundaries back, errors {metrics['errors']}",
                flush=True,
            )
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if master is not None:
            master.stop()
    ref = servers["device"]["metrics"]
    ratios = {
        n: {m: (servers[n]["metrics"][m] / ref[m]) if ref[m] else None for m in METRICS} for n in NAMES if n != "device"
    }
    greedy = {}
    for n in NAMES[1:]:
        a, b = outputs["device"], outputs[n]
        keys = set(a) & set(b)
        greedy[n] = {"compared": len(keys), "mismatches": sorted(k for k in keys if a[k] != b[k])}
    errors = sum(s["metrics"]["errors"] for s in servers.values())
    result = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(shlex.quote(x) for x in ["python", "-m", "benchmarks.tier_ab", *(argv or sys.argv[1:])]),
        "runtime_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "git": git_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "quiet")},
        "servers": servers,
        "ratios_over_device": ratios,
        "greedy_vs_device": greedy,
        "errors": errors,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(
        servers,
        os.path.join(args.out, "tier_ab.png"),
        f"k3 on CPU, one device budget ({args.device_args}); {args.conversations} chats x {args.turns} turns",
    )
    for n, r in ratios.items():
        print(f"{n} / device: " + ", ".join(f"{m} {v:.3f}" for m, v in r.items() if v is not None))
    for n, g in greedy.items():
        print(f"greedy {n} vs device: {len(g['mismatches'])} mismatches of {g['compared']}")
    print(f"wrote {args.out}/results.json and tier_ab.png in {result['runtime_s']:.0f}s")
    return 3 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
