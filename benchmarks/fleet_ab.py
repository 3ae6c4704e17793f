"""The fleet live, on CPU: ``python -m benchmarks.fleet_ab``.

The same multi-turn workload (each chat's id in ``X-SMG-Routing-Key``) runs on:

* ``single``: one ``sglang_k3.launch_server`` with the per-instance device budget;
* ``single_big``: one instance with ``--instances`` x that budget (KV tokens, state slots, running
  requests): the fleet's memory in one place, the reference the fleet is compared with;
  ``single_big+L3``: the same with a Mooncake L3 of its own (the reference of the fleets with L3);
* a fleet of ``--instances`` instances with that budget each, as ``scripts/start_fleet.py`` ships
  it (``LocalFleet``: a real ``mooncake_master``, write-through to the shared L3, admission budgets
  at 2048 tokens), behind a real sglang-router with each of ``--routings``;
* the same fleet without the shared L3 (``--no-shared-l3``), with each routing.

Between two routings the instances' device caches are flushed and the Mooncake pool is emptied, so
every run starts cold. Reports per run the token hit rate, prefill tokens, TTFT p50/p90, output
tokens/s (all instances share this machine's cores: the fleet's throughput is not 3x here), the
prefix tokens restored from the shared L3, and each instance's share of requests; its fraction of
the big instance's hit rate with the same L3 setting, and of the best routing's. Each fleet ends
with a failover probe (:func:`failover_probe`): an instance is stopped mid-conversation, and the
spread of its sessions over the survivors, their hit rate and any failed request are recorded.
Greedy tokens are compared with ``single_big``'s (int8 checkpoints, as shipped: a restore at
another boundary may flip a near-tie; mismatches are counted). Writes OUT/results.json and
OUT/fleet_ab.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402
from sglang_k3.fleet.instance import Server, ServerStartError, flush_cache, k3_state  # noqa: E402
from sglang_k3.fleet.instance_info import ROUTING_KEY_HEADER  # noqa: E402
from sglang_k3.fleet.local_fleet import SHARED_L3_ARGS, FleetSpec, LocalFleet  # noqa: E402
from sglang_k3.fleet.router_process import RouterStartError  # noqa: E402
from sglang_k3.tiers.mooncake_master import MooncakeMaster  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "fleet_ab")
ROUTINGS = ("round_robin", "cache_aware", "consistent_hashing")
SHIPPED_FLEET_ARGS = ("--k3-admission-thresholds", "2048")  # scripts/start_fleet.py's default
SCHEMA = "sglang_k3.fleet_ab/1"
TARGET_FRACTION = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet_ab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--instances", type=int, default=3, help="instances in the fleet (default 3)")
    p.add_argument("--kv-tokens", type=int, default=2048, help="per instance: --max-total-tokens (default 2048)")
    p.add_argument("--state-slots", type=int, default=8, help="per instance: --max-mamba-cache-size (default 8)")
    p.add_argument("--running", type=int, default=4, help="per instance: --max-running-requests (default 4)")
    p.add_argument("--server-args", default="", help="extra flags for every server, one shell-quoted string")
    p.add_argument("--routings", default=",".join(ROUTINGS), help="comma-separated router policies (default: all)")
    p.add_argument("--no-l3-runs", action="store_true", help="skip the fleet without the shared L3")
    p.add_argument("--store-mib", type=int, default=1024, help="the fleet's Mooncake pool (a store client), MiB")
    p.add_argument("--segment-mib", type=int, default=512, help="single_big+L3's own Mooncake segment, MiB")
    p.add_argument(
        "--failover-sessions",
        type=int,
        default=24,
        help="sessions of the failover probe at the end of each fleet (an instance is stopped; 0: skip)",
    )
    wl.add_multiturn_args(p, conversations=12, turns=4, first_len=512, user_len=128, reply_len=32)
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="server logs (default: the temp directory)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    wl.check_multiturn_args(p, args)
    args.routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    bad = [r for r in args.routings if r not in ROUTINGS]
    if bad or not args.routings:
        p.error(f"--routings: unknown {bad}; choose from {', '.join(ROUTINGS)}")
    if args.instances < 2:
        p.error("--instances must be >= 2")
    if args.failover_sessions < 0:
        p.error("--failover-sessions must be >= 0")
    for name in ("kv_tokens", "state_slots", "running", "segment_mib", "store_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def device_args(args, scale: int = 1) -> list[str]:
    return [
        "--max-total-tokens", str(args.kv_tokens * scale),
        "--max-mamba-cache-size", str(args.state_slots * scale),
        "--max-running-requests", str(args.running * scale),
    ]  # fmt: skip


def _keyed(url: str) -> int:
    return requests.get(url + "/k3_fleet_info", timeout=60).json()["requests_with_session_key"]


def run_workload(url: str, label: str, vocab, args, instance_urls: list[str]) -> tuple[dict, dict]:
    before = {u: (k3_state(u), _keyed(u)) for u in instance_urls}
    metrics, outs = wl.run_multiturn(
        url, label, vocab, verbose=not args.quiet, session_header=ROUTING_KEY_HEADER, **wl.multiturn_kwargs(args)
    )
    l3 = host = 0
    shares = []
    for u in instance_urls:
        k3, keyed = k3_state(u), _keyed(u)
        l3 += k3.get("tier_l3_hit_tokens", 0) - before[u][0].get("tier_l3_hit_tokens", 0)
        host += k3.get("tier_host_hit_tokens", 0) - before[u][0].get("tier_host_hit_tokens", 0)
        shares.append(keyed - before[u][1])
    total = sum(shares) or 1
    run = {
        "metrics": metrics,
        "l3_hit_tokens": l3,
        "host_hit_tokens": host,
        "instance_request_shares": [s / total for s in shares],
    }
    return run, outs


def failover_probe(fleet: LocalFleet, vocab, args) -> dict:
    """``--failover-sessions`` chats of two turns under ``consistent_hashing``: turn 1 on the
    healthy fleet; then the instance holding the most of them is stopped; turn 2 of every chat.
    Measures where the dead instance's sessions went (the re-prefill's spread), how much of their
    turn-2 prompts still hit (restored from the shared L3, if any), and failures (must be none)."""
    import random

    from benchmarks.live.client import generate_stream

    fleet.start_router("consistent_hashing")
    rng = random.Random(args.seed + 77)
    hdr = ROUTING_KEY_HEADER
    convs = {f"fo{i}": [rng.choice(vocab) for _ in range(rng.randint(200, 400))] for i in range(args.failover_sessions)}
    failed = 0
    for key, ids in convs.items():
        r = generate_stream(fleet.url, key, ids, args.reply_len, headers={hdr: key})
        failed += r.error is not None
        convs[key] = ids + r.output_ids + [rng.choice(vocab) for _ in range(64)]

    before = fleet.session_keys()
    home = {k: next(u for u, keys in before.items() if k in keys) for k in convs}
    victim = max(before, key=lambda u: sum(1 for k in convs if home[k] == u))
    moved = [k for k in convs if home[k] == victim]
    next(s for s in fleet.instances if s.url == victim).stop()
    t0 = time.perf_counter()
    prompt = cached = 0
    for key, ids in convs.items():
        r = generate_stream(fleet.url, key, ids, args.reply_len, headers={hdr: key})
        failed += r.error is not None
        if key in moved and r.error is None:
            prompt, cached = prompt + r.prompt_tokens, cached + r.cached_tokens
    after = fleet.session_keys()
    landed: dict[str, int] = {}
    for k in moved:
        for u, keys in after.items():
            if k in keys:
                landed[u] = landed.get(u, 0) + 1
    return {
        "sessions": len(convs),
        "killed_instance_sessions": len(moved),
        "moved_to": sorted(landed.values(), reverse=True),
        "survivors": len(after),
        "moved_sessions_hit_rate": cached / prompt if prompt else None,
        "failed_requests": failed,
        "second_turn_seconds": time.perf_counter() - t0,
    }


def save_partial(args, runs: dict) -> None:
    """The runs so far (``partial.json``), so a late failure loses no measurement."""
    with open(os.path.join(args.out, "partial.json"), "w") as f:
        json.dump(runs, f, indent=1)


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    vals = [runs[n]["metrics"]["hit_rate"] or 0 for n in names]
    fig, ax = plt.subplots(figsize=(max(7, len(names) * 1.1), 4.5))
    bars = ax.bar(range(len(names)), vals, color=["#777" if n.startswith("single") else "#3a7" for n in names])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("token hit rate")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fleet_runs(args, vocab, shared_l3: bool, base: list[str], runs: dict, outputs: dict, failover: dict) -> None:
    spec = FleetSpec(
        instances=args.instances,
        policy=args.routings[0],
        shared_l3=shared_l3,
        store_segment_bytes=args.store_mib << 20,
        instance_args=tuple(SHIPPED_FLEET_ARGS) + tuple(base),
        log_dir=args.log_dir,
    )
    with LocalFleet(spec) as fleet:
        urls = [s.url for s in fleet.instances]
        for i, routing in enumerate(args.routings):
            if i:
                fleet.start_router(routing)
            name = f"{routing}{'+L3' if shared_l3 else ''}"
            run, outs = run_workload(fleet.url, name, vocab, args, urls)
            run["command"] = " ".join(fleet.router.command)
            runs[name], outputs[name] = run, outs
            save_partial(args, runs)
            m = run["metrics"]
            print(
                f"{name}: hit {m['hit_rate']:.3f}, prefill {m['prefill_tokens']}, TTFT p50 {m['ttft_p50_s']:.2f}s, "
                f"L3 tokens {run['l3_hit_tokens']}, shares {[round(s, 2) for s in run['instance_request_shares']]}",
                flush=True,
            )
            for u in urls:  # a cold start for the next routing
                flush_cache(u)
            if fleet.master is not None:
                fleet.master.clear()
        if args.failover_sessions:
            key = "shared_l3" if shared_l3 else "no_l3"
            failover[key] = fo = failover_probe(fleet, vocab, args)
            print(f"failover ({key}): {fo}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers it started on the way out
    os.makedirs(args.out, exist_ok=True)
    from sglang_k3.model.tiny_build import default_model_path

    vocab = wl.vocabulary(default_model_path())
    t0 = time.perf_counter()
    extra = shlex.split(args.server_args)
    log_dir = args.log_dir or tempfile.gettempdir()
    runs: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    failover: dict[str, dict] = {}
    try:
        for name, scale, l3 in (
            ("single", 1, False),
            ("single_big", args.instances, False),
            ("single_big+L3", args.instances, True),
        ):
            master = MooncakeMaster().start() if l3 else None
            env = master.client_env(args.segment_mib << 20) if master else None
            flags = device_args(args, scale) + extra + (list(SHARED_L3_ARGS) if l3 else [])
            srv = Server(name, flags, log_dir=log_dir, log_prefix="fleet_ab", env=env).start()
            try:
                run, outs = run_workload(srv.url, name, vocab, args, [srv.url])
            finally:
                srv.stop()
                if master is not None:
                    master.stop()
            run["command"] = " ".join(srv.command)
            runs[name], outputs[name] = run, outs
            save_partial(args, runs)
            m = run["metrics"]
            print(f"{name}: hit {m['hit_rate']:.3f}, TTFT p50 {m['ttft_p50_s']:.2f}s", flush=True)
        base = device_args(args) + extra
        _fleet_runs(args, vocab, True, base, runs, outputs, failover)
        if not args.no_l3_runs:
            _fleet_runs(args, vocab, False, base, runs, outputs, failover)
    except (ServerStartError, RouterStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, run in runs.items():  # against one big instance with the same L3 setting
        ref = runs["single_big+L3" if name.endswith("+L3") else "single_big"]["metrics"]["hit_rate"] or 0.0
        run["single_big_fraction"] = (run["metrics"]["hit_rate"] or 0.0) / ref if ref else None
    for l3 in (True, False):
        group = [n for n in runs if not n.startswith("single") and n.endswith("+L3") == l3]  # the fleets
        best = max(((runs[n]["metrics"]["hit_rate"] or 0.0) for n in group), default=0.0)
        for n in group:
            runs[n]["best_routing_fraction"] = (runs[n]["metrics"]["hit_rate"] or 0.0) / best if best else None
    ref = outputs["single_big"]
    greedy = {}
    for n, outs in outputs.items():
        keys = set(ref) & set(outs)
        greedy[n] = {"compared": len(keys), "mismatches": sum(ref[k] != outs[k] for k in keys)}
    errors = sum(r["metrics"]["errors"] for r in runs.values()) + sum(f["failed_requests"] for f in failover.values())
    with_l3 = [runs[n]["best_routing_fraction"] for n in runs if n.endswith("+L3") and not n.startswith("single")]
    result = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(shlex.quote(x) for x in ["python", "-m", "benchmarks.fleet_ab", *(argv or sys.argv[1:])]),
        "runtime_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "git": git_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "quiet")},
        "runs": runs,
        "greedy_vs_single_big": greedy,
        "failover": failover,
        "target": {
            "every_routing_with_l3_at_least_of_best": TARGET_FRACTION,
            "worst": min(with_l3) if with_l3 else None,
            "met": bool(with_l3) and min(with_l3) >= TARGET_FRACTION,
        },
        "errors": errors,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    if os.path.exists(os.path.join(args.out, "partial.json")):
        os.remove(os.path.join(args.out, "partial.json"))
    title = (
        f"k3 fleet on CPU: {args.instances} x ({args.kv_tokens} KV tokens, {args.state_slots} states) vs one of "
        f"{args.instances}x; {args.conversations} chats x {args.turns} turns"
    )
    plot(runs, os.path.join(args.out, "fleet_ab.png"), title)
    print(f"{'run':<24} {'hit':>6} {'/big':>6} {'/best':>6} {'TTFT50':>7} {'L3 tok':>7} greedy-mismatch")
    for n, r in runs.items():
        bf = r.get("best_routing_fraction")
        print(
            f"{n:<24} {r['metrics']['hit_rate']:>6.3f} {r['single_big_fraction']:>6.3f} "
            f"{'-' if bf is None else f'{bf:.3f}':>6} {r['metrics']['ttft_p50_s']:>7.2f} {r['l3_hit_tokens']:>7} "
            f"{greedy[n]['mismatches']}/{greedy[n]['compared']}"
        )
    print(f"target (with the shared L3 every routing >= {TARGET_FRACTION} of the best): {result['target']}")
    print(f"wrote {args.out}/results.json and fleet_ab.png in {result['runtime_s']:.0f}s")
    return 3 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
