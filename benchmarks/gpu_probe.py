"""Does a server configuration serve? Start each named configuration in turn, send it a small
multi-turn workload (a batch of concurrent first turns, then one more turn each), and report per
configuration whether it started, how many requests came back, and the server log's first error.

    python -m benchmarks.gpu_probe --server-args "--model-path M --dtype bfloat16 ..." \\
        --config big="--mem-fraction-static 0.12" --config small="--max-total-tokens 65536" \\
        --out DIR

Made for bisecting a configuration that fails on the GPU (``benchmarks/gpu_serving.sh probe``), where
a device call is minutes: one call tries several. Each configuration's server is stopped before the
next starts (servers left behind hold GPU memory). ``CUDA_LAUNCH_BLOCKING=1`` in an ``--env`` makes
an illegal memory access surface at the kernel that made it. Writes ``DIR/probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_probe",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--server-args", required=True, help="launch_server arguments every configuration shares")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a configuration: its name and the launch_server arguments it adds (repeat; tried in order)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE",
        help="an environment variable for configuration NAME's server (repeat)",
    )
    p.add_argument("--conversations", type=int, default=6, help="concurrent conversations")
    p.add_argument("--prompt-len", type=int, default=2048, help="first-turn prompt tokens")
    p.add_argument("--turn-len", type=int, default=256, help="new tokens of the second turn")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--start-timeout", type=float, default=240.0, help="seconds for a server to become healthy")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", required=True, help="output folder (probe.json, server logs)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if not a.config:
        p.error("give at least one --config NAME=ARGS")
    configs = {}
    for c in a.config:
        name, sep, args = c.partition("=")
        if not sep or not name:
            p.error(f"--config wants NAME=ARGS, got {c!r}")
        configs[name] = shlex.split(args)
    env: dict = {n: {} for n in configs}
    for e in a.env:
        name, sep, kv = e.partition(":")
        var, eq, val = kv.partition("=")
        if not sep or not eq or name not in configs:
            p.error(f"--env wants NAME:VAR=VALUE with NAME one of {', '.join(configs)}, got {e!r}")
        env[name][var] = val
    a.configs, a.envs = configs, env
    if a.conversations < 1 or a.prompt_len < 1 or a.max_new_tokens < 1:
        p.error("--conversations, --prompt-len and --max-new-tokens must be >= 1")
    return a


def first_error(log_path: str) -> str | None:
    """The log's first traceback: the line before it (what failed) and the error lines in it; or
    the first line naming a CUDA error."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [x.rstrip() for x in f]
    except OSError:
        return None
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            block = lines[i : i + 120]
            errs = [x for x in block if "Error:" in x or "Error(" in x or "error:" in x]
            head = line if line.split("Traceback")[0].strip(" []:0123456789-") else lines[i - 1] if i else line
            return "\n".join([head, *errs[:4]])[:2000]
    for line in lines:
        if "illegal memory access" in line or "CUDA error" in line:
            return line[:2000]
    return None


def _k3_memory(url: str) -> dict:
    """The k3 cache's unified-memory fields and page copies from ``/server_info`` ({} for other
    caches, or when the server does not answer)."""
    from sglang_k3.fleet.instance import k3_state

    try:
        st = k3_state(url)
    except Exception as e:  # a probe reports, it does not stop at a missing field
        return {"error": f"{type(e).__name__}: {e}"}
    return {k: v for k, v in (st or {}).items() if k.startswith("memory_") or k == "kv_page_copies"}


def main(argv=None) -> int:
    a = parse_args(argv)
    from benchmarks.live.client import generate_stream
    from benchmarks.live.server import Server, ServerStartError

    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    vocab = list(range(3, 250))
    firsts = [[rng.choice(vocab) for _ in range(a.prompt_len)] for _ in range(a.conversations)]
    seconds = [[rng.choice(vocab) for _ in range(a.turn_len)] for _ in range(a.conversations)]
    report = {"command": "python -m benchmarks.gpu_probe " + shlex.join(argv or sys.argv[1:]), "configs": {}}
    base = shlex.split(a.server_args)
    rc = 0
    for name, extra in a.configs.items():
        t0 = time.time()
        s = Server(
            name,
            base + extra,
            start_timeout=a.start_timeout,
            log_dir=a.out,
            log_prefix="probe",
            env=a.envs[name] or None,
        )
        rec = {"args": base + extra, "env": a.envs[name], "log": os.path.basename(s.log_path)}
        print(f"[{name}] starting: {shlex.join(extra)}", flush=True)
        try:
            s.start()
            rec["start_s"] = round(time.time() - t0, 1)

            def convo(c: int) -> list:
                out = []
                r1 = generate_stream(s.url, f"c{c}/t0", firsts[c], a.max_new_tokens, timeout=120)
                out.append(r1)
                if r1.error is None:
                    out.append(
                        generate_stream(
                            s.url, f"c{c}/t1", firsts[c] + r1.output_ids + seconds[c], a.max_new_tokens, timeout=120
                        )
                    )
                return out

            with ThreadPoolExecutor(a.conversations) as ex:
                results = [r for rs in ex.map(convo, range(a.conversations)) for r in rs]
            rec["requests"] = len(results)
            rec["errors"] = [r.error for r in results if r.error]
            # the second turns' hits, and the k3 cache's memory as the server reports it
            rec["prompt_tokens_turn2"] = sum(r.prompt_tokens for r in results[1::2])
            rec["cached_tokens_turn2"] = sum(r.cached_tokens for r in results[1::2])
            rec["k3"] = _k3_memory(s.url)
            rec["served"] = not rec["errors"] and len(results) == 2 * a.conversations and s.alive()
        except ServerStartError as e:
            rec["start_error"] = str(e).splitlines()[0]
            rec["served"] = False
        finally:
            s.stop()
        rec["first_log_error"] = first_error(s.log_path)
        rec["wall_s"] = round(time.time() - t0, 1)
        rc |= 0 if rec["served"] else 1
        print(f"[{name}] served={rec['served']} in {rec['wall_s']}s; first error: {rec['first_log_error']}", flush=True)
        report["configs"][name] = rec
        with open(os.path.join(a.out, "probe.json"), "w") as f:  # after each: a cut run keeps what finished
            json.dump(report, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
