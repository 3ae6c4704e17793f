"""Admission budgets under a burst of long prompts, live on CPU: ``python -m benchmarks.fleet_burst``.

Two ``sglang_k3.launch_server`` servers, one at a time, identical but for the budgets:

* ``no_budgets``: the default server (every request goes to the scheduler at once);
* ``budgets``: ``--k3-admission-thresholds LONG`` (prompts of ``--long-threshold`` tokens or more
  are the long class, which may hold half the prefill capacity, SGLang's ``--chunked-prefill-size``).

On each: short prompts alone (``--clients`` clients in a loop), one long prompt alone, then the
burst: ``--longs`` long prompts sent at once while the same short clients keep going until the
last long one has its first token. Reports the short requests' TTFT p50/p90 alone and during the
burst, and the long ones' TTFT, per server and as ratios (``budgets`` over ``no_budgets``).

The stated bound: with budgets, the long class holds at most ``n = max(1, floor(budget / long_len))``
long prompts in flight (admitted, prefill not done). A short request that arrives while one of them
is being prefilled waits for that step, and SGLang's prefill batch, filled first come first served
up to the chunk size, may then put it beside the next admitted long prompt. So it waits for at most
``n + 1`` long prefills, and its TTFT p90 during the burst is at most ``short p90 alone + (n + 1) x
(one long prompt's TTFT alone)``. The JSON records the bound and whether it held; without budgets
the wait grows with the burst (up to all ``--longs``).
Writes OUT/results.json and OUT/fleet_burst.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live.client import generate_stream, percentile  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402
from sglang_k3.fleet.instance import Server, ServerStartError  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "fleet_burst")
SCHEMA = "sglang_k3.fleet_burst/1"
CHUNK = 4096  # SGLang's --chunked-prefill-size on this CPU path (resolved; /server_info)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet_burst",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--long-threshold", type=int, default=2048, help="long class from this prompt length (default 2048)")
    p.add_argument("--long-len", type=int, default=3000, help="tokens of each long prompt (default 3000)")
    p.add_argument("--longs", type=int, default=6, help="long prompts in the burst (default 6)")
    p.add_argument("--short-len", type=int, default=96, help="tokens of each short prompt (default 96)")
    p.add_argument("--clients", type=int, default=3, help="short-request clients (default 3)")
    p.add_argument("--alone", type=int, default=12, help="short requests measured alone (default 12)")
    p.add_argument("--server-args", default="", help="extra flags for both servers, one shell-quoted string")
    p.add_argument("--seed", type=int, default=0, help="workload seed (recorded)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="server logs (default: the temp directory)")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    for n in ("long_threshold", "long_len", "longs", "short_len", "clients", "alone"):
        if getattr(a, n) < 1:
            p.error(f"--{n.replace('_', '-')} must be >= 1")
    if a.short_len >= a.long_threshold or a.long_len < a.long_threshold:
        p.error("need --short-len < --long-threshold <= --long-len")
    if a.long_len + 64 > 8192:
        p.error("--long-len must leave room in the server's 8192-token context")
    return a


def _prompt(rng: random.Random, vocab, n: int) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def measure(url: str, vocab, args) -> dict:
    rng = random.Random(args.seed)
    out: dict = {}
    alone = []
    for i in range(args.alone):
        r = generate_stream(url, f"alone{i}", _prompt(rng, vocab, args.short_len), 4)
        if r.error:
            raise RuntimeError(f"short request failed: {r.error}")
        alone.append(r.ttft_s)
    long_alone = generate_stream(url, "long_alone", _prompt(rng, vocab, args.long_len), 4)
    if long_alone.error:
        raise RuntimeError(f"long request failed: {long_alone.error}")
    longs = [_prompt(rng, vocab, args.long_len) for _ in range(args.longs)]
    shorts_ttft: list = []
    long_results: list = []
    done = threading.Event()
    errors: list = []
    lock = threading.Lock()

    def short_client(c: int) -> None:
        r2 = random.Random(args.seed * 1000 + c)
        k = 0
        while not done.is_set():
            res = generate_stream(url, f"s{c}/{k}", _prompt(r2, vocab, args.short_len), 4)
            k += 1
            with lock:
                (errors.append(res.error) if res.error else shorts_ttft.append(res.ttft_s))

    def long_req(i: int):
        return generate_stream(url, f"long{i}", longs[i], 4)

    with ThreadPoolExecutor(args.clients + args.longs) as ex:
        lf = [ex.submit(long_req, i) for i in range(args.longs)]
        time.sleep(0.2)
        sf = [ex.submit(short_client, c) for c in range(args.clients)]
        for f in lf:
            long_results.append(f.result())
        done.set()
        for f in sf:
            f.result()
    errors += [r.error for r in long_results if r.error]
    out["short_alone_ttft_p50_s"] = percentile(alone, 50)
    out["short_alone_ttft_p90_s"] = percentile(alone, 90)
    out["long_alone_ttft_s"] = long_alone.ttft_s
    out["short_burst_ttft_p50_s"] = percentile(shorts_ttft, 50)
    out["short_burst_ttft_p90_s"] = percentile(shorts_ttft, 90)
    out["short_burst_requests"] = len(shorts_ttft)
    lt = [r.ttft_s for r in long_results if r.error is None]
    out["long_burst_ttft_p50_s"] = percentile(lt, 50)
    out["long_burst_ttft_max_s"] = max(lt) if lt else None
    out["errors"] = errors
    return out


def plot(res: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["short_alone_ttft_p90_s", "short_burst_ttft_p50_s", "short_burst_ttft_p90_s", "long_burst_ttft_p50_s"]
    labels = ["short alone p90", "short in burst p50", "short in burst p90", "long in burst p50"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = 0.38
    for j, name in enumerate(("no_budgets", "budgets")):
        vals = [res[name][k] or 0 for k in keys]
        bars = ax.bar([i + (j - 0.5) * w for i in range(len(keys))], vals, w, label=name)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(res["bound_s"], color="k", ls="--", lw=1, label=f"stated bound {res['bound_s']:.2f}s")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from sglang_k3.model.tiny_build import default_model_path

    vocab = wl.vocabulary(default_model_path())
    t0 = time.perf_counter()
    extra = shlex.split(args.server_args)
    configs = {"no_budgets": extra, "budgets": ["--k3-admission-thresholds", str(args.long_threshold), *extra]}
    res: dict = {}
    try:
        for name, flags in configs.items():
            srv = Server(name, flags, log_dir=args.log_dir or tempfile.gettempdir(), log_prefix="fleet_burst").start()
            try:
                res[name] = measure(srv.url, vocab, args)
                res[name]["command"] = " ".join(srv.command)
            finally:
                srv.stop()
            r = res[name]
            print(
                f"{name}: short TTFT alone p90 {r['short_alone_ttft_p90_s']:.2f}s, in burst p50 "
                f"{r['short_burst_ttft_p50_s']:.2f}s p90 {r['short_burst_ttft_p90_s']:.2f}s; long alone "
                f"{r['long_alone_ttft_s']:.2f}s, in burst p50 {r['long_burst_ttft_p50_s']:.2f}s",
                flush=True,
            )
    except (ServerStartError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    b = res["budgets"]
    budget = CHUNK // 2
    n_ahead = max(1, budget // args.long_len)
    res["bound_s"] = b["short_alone_ttft_p90_s"] + (n_ahead + 1) * b["long_alone_ttft_s"]
    res["bound"] = (
        f"short TTFT p90 in the burst <= short p90 alone + ({n_ahead} in flight + 1 running) x one long "
        f"prompt's TTFT alone (long class budget {budget} tokens, long prompts of {args.long_len})"
    )
    res["bound_held"] = b["short_burst_ttft_p90_s"] <= res["bound_s"]
    keys = ("short_burst_ttft_p50_s", "short_burst_ttft_p90_s", "long_burst_ttft_p50_s", "long_burst_ttft_max_s")
    nb = res["no_budgets"]
    res["ratios_budgets_over_no_budgets"] = {k: (b[k] / nb[k]) if nb[k] else None for k in keys}
    errors = len(b["errors"]) + len(nb["errors"])
    result = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join(["python", "-m", "benchmarks.fleet_burst", *(argv or sys.argv[1:])]),
        "runtime_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "git": git_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
        **res,
        "errors": errors,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(
        res,
        os.path.join(args.out, "fleet_burst.png"),
        f"{args.longs} long prompts ({args.long_len} tok) at once, {args.clients} short clients ({args.short_len} tok)",
    )
    print(f"budgets / no_budgets: {res['ratios_budgets_over_no_budgets']}")
    print(f"bound: {res['bound']} = {res['bound_s']:.2f}s; held: {res['bound_held']}")
    print(f"wrote {args.out}/results.json and fleet_burst.png in {result['runtime_s']:.0f}s")
    return 3 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
