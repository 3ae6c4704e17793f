"""Differential soak: many seeded random scripts, ``k3`` against no cache; prints mismatches.

    python -m benchmarks.soak --seeds 20
    python -m benchmarks.soak --seeds 50 --k3-args "--k3-checkpoint-dtype fp32 --chunked-prefill-size 96"

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
    p.add_argument("--out", default="benchmarks/results/soak", help="output directory")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.rounds < 1:
        p.error("--seeds and --rounds must be >= 1")
    common = shlex.split(args.server_args)
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
        records = []
        total_mismatch = cached = prompt = 0
        for i in range(args.seeds):
            seed = args.start_seed + i
            script = make_script(seed, n_rounds=args.rounds)
            a, b = run_script(k3, script), run_script(plain, script)
            bad = compare(a, b)
            total_mismatch += len(bad)
            c, n = sum(r["cached_tokens"] for r in a), sum(r["prompt_len"] for r in a)
            cached, prompt = cached + c, prompt + n
            records.append({"seed": seed, "requests": len(a), "mismatches": bad, "hit_rate": c / n})
            print(
                f"[soak] seed {seed}: {len(a)} requests, {len(bad)} mismatches, hit rate {c / n:.3f}"
                f" ({i + 1}/{args.seeds}, {time.time() - t0:.0f}s)",
                file=sys.stderr,
            )
            for line in bad:
                print(f"[soak]   {line}", file=sys.stderr)
    except ServerStartError as e:
        print(f"[soak] a server failed to start:\n{e}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            s.stop()
    summary = {
        "seeds": args.seeds,
        "start_seed": args.start_seed,
        "k3_args": args.k3_args,
        "mismatches": total_mismatch,
        "token_hit_rate": cached / prompt,
        "seconds": round(time.time() - t0, 1),
        "per_seed": records,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"mismatches: {total_mismatch}  token hit rate: {cached / prompt:.3f}  "
        f"({args.seeds} seeds, {summary['seconds']}s)"
    )
    return 1 if total_mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
