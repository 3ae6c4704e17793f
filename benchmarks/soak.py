"""Differential soak: many seeded random scripts, ``k3`` against no cache; prints mismatches.

    python -m benchmarks.soak --seeds 20
    python -m benchmarks.soak --seeds 50 --k3-args "--k3-checkpoint-dtype fp32 --chunked-prefill-size 96"
    python -m benchmarks.soak --matrix --seeds 10

Each seed is a script of multi-turn conversations over a shared system prompt, concurrent fork
branches, repeated prompts and prompts ending mid-chunk (``benchmarks/live/differential.py``, the
same generator the tests use). The same script runs on a server with the k3 cache and on one with
``--disable-radix-cache``; greedy tokens must be equal. Mismatches must be 0 (exit code 1
otherwise). Writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from benchmarks.live.differential import compare, make_script, run_script
from benchmarks.live.server import Server, ServerStartError

DEFAULT_K3_ARGS = "--k3-checkpoint-dtype fp32"


# --matrix: every combination #11 asks the soak to cover, each a k3 server against one shared
# cache-off server. fp32 checkpoints must give 0 mismatches; int8 restores continue from a
# quantized state, so their agreement is reported (as tests/test_int8_agreement.py does).
MATRIX = {
    f"overlap {ov}, page {page}, {dtype}": " ".join(
        ["--page-size", str(page), "--k3-checkpoint-dtype", dtype]
        + ([] if ov == "on" else ["--disable-overlap-schedule"])
    )
    for ov in ("on", "off")
    for page in (1, 64)
    for dtype in ("fp32", "int8")
}


def soak(k3: Server, plain: Server, seeds: range, rounds: int, t0: float, label: str = "") -> dict:
    """Run ``seeds`` scripts on both servers; greedy tokens compared request by request."""
    records = []
    total_mismatch = cached = prompt = agree = tokens = 0
    for i, seed in enumerate(seeds):
        script = make_script(seed, n_rounds=rounds)
        a, b = run_script(k3, script), run_script(plain, script)
        bad = compare(a, b)
        total_mismatch += len(bad)
        c, n = sum(r["cached_tokens"] for r in a), sum(r["prompt_len"] for r in a)
        cached, prompt = cached + c, prompt + n
        for x, y in zip(a, b):
            same = next((j for j, (u, v) in enumerate(zip(x["output_ids"], y["output_ids"])) if u != v), None)
            agree += len(y["output_ids"]) if same is None else same
            tokens += len(y["output_ids"])
        records.append({"seed": seed, "requests": len(a), "mismatches": bad, "hit_rate": c / n})
        print(
            f"[soak]{label} seed {seed}: {len(a)} requests, {len(bad)} mismatches, hit rate {c / n:.3f}"
            f" ({i + 1}/{len(seeds)}, {time.time() - t0:.0f}s)",
            file=sys.stderr,
        )
        for line in bad:
            print(f"[soak]   {line}", file=sys.stderr)
    return {
        "mismatches": total_mismatch,
        "requests": sum(r["requests"] for r in records),
        "token_hit_rate": cached / prompt,
        "greedy_token_agreement": agree / max(1, tokens),
        "per_seed": records,
    }


def run_matrix(args, common: list[str]) -> int:
    """Every combination of :data:`MATRIX` over the same seeds, against one cache-off server."""
    t0 = time.time()
    plain = Server("soak_nocache", common + ["--disable-radix-cache"], log_prefix="sglang_k3_soak")
    rows = {}
    try:
        plain.start()
        for label, k3_args in MATRIX.items():
            k3 = Server("soak_k3", common + shlex.split(k3_args), log_prefix="sglang_k3_soak")
            try:
                k3.start()
                print(f"[soak] {label}: k3 up at {k3.url} ({k3_args})", file=sys.stderr)
                seeds = range(args.start_seed, args.start_seed + args.seeds)
                rows[label] = {"k3_args": k3_args, **soak(k3, plain, seeds, args.rounds, t0, f" [{label}]")}
            finally:
                k3.stop()
    except ServerStartError as e:
        print(f"[soak] a server failed to start:\n{e}", file=sys.stderr)
        return 1
    finally:
        plain.stop()
    summary = {"seeds": args.seeds, "start_seed": args.start_seed, "rounds": args.rounds, "combinations": rows}
    summary["seconds"] = round(time.time() - t0, 1)
    _write(args.out, summary)
    exact_bad = 0
    print(f"{'combination':34} {'mismatches':>10} {'requests':>8} {'agreement':>9} {'hit rate':>8}")
    for label, r in rows.items():
        print(
            f"{label:34} {r['mismatches']:>10} {r['requests']:>8} {r['greedy_token_agreement']:>9.4f}"
            f" {r['token_hit_rate']:>8.3f}"
        )
        exact_bad += r["mismatches"] if "fp32" in label else 0
    return 1 if exact_bad else 0


def _write(out: str, summary: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20, help="number of scripts (default 20)")
    p.add_argument("--start-seed", type=int, default=1000, help="first seed (default 1000)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per script (default 4)")
    p.add_argument(
        "--k3-args",
        default=DEFAULT_K3_ARGS,
        help=f"extra launch_server flags for the k3 server (default {DEFAULT_K3_ARGS!r}: "
        "fp32 checkpoints are the bit-exact oracle)",
    )
    p.add_argument("--server-args", default="", help="extra flags for both servers (e.g. --model-path)")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="soak every combination of overlap scheduler on/off, --page-size 1/64 and fp32/int8 "
        "checkpoints (--k3-args is ignored); exit code 1 if an fp32 combination mismatches",
    )
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/soak, or soak_matrix)")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.rounds < 1:
        p.error("--seeds and --rounds must be >= 1")
    common = shlex.split(args.server_args)
    if args.matrix:
        args.out = args.out or "benchmarks/results/soak_matrix"
        return run_matrix(args, common)
    args.out = args.out or "benchmarks/results/soak"
    servers = [
        Server("soak_k3", common + shlex.split(args.k3_args), log_prefix="sglang_k3_soak"),
        Server("soak_nocache", common + ["--disable-radix-cache"], log_prefix="sglang_k3_soak"),
    ]
    t0 = time.time()
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_healthy()
            print(f"[soak] {s.name} up at {s.url}", file=sys.stderr)
        k3, plain = servers
        result = soak(k3, plain, range(args.start_seed, args.start_seed + args.seeds), args.rounds, t0)
    except ServerStartError as e:
        print(f"[soak] a server failed to start:\n{e}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            s.stop()
    summary = {"seeds": args.seeds, "start_seed": args.start_seed, "k3_args": args.k3_args, **result}
    summary["seconds"] = round(time.time() - t0, 1)
    _write(args.out, summary)
    total_mismatch = result["mismatches"]
    print(
        f"mismatches: {total_mismatch}  token hit rate: {result['token_hit_rate']:.3f}  "
        f"({args.seeds} seeds, {summary['seconds']}s)"
    )
    return 1 if total_mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
