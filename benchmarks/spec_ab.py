"""Speculative decoding with the k3 cache against the alternatives: ``python -m benchmarks.spec_ab``.

The same workloads on four servers of the embedded model, one after another (issue #34):

* ``k3_spec``: the k3 cache with NGRAM speculative decoding (``--speculative-algorithm NGRAM``);
* ``k3``: the k3 cache without speculation;
* ``upstream_spec``: SGLang's own cache with NGRAM, in the mode its hybrid cache needs for it
  (``extra_buffer``: launch_server's default for ``--radix-cache-backend upstream``);
* ``off_spec``: no prefix cache, with NGRAM.

Every server runs ``--server-args`` (default: none, what ships: int8 checkpoints) and the speculative
ones ``--spec-args`` (default NGRAM with ``--speculative-num-draft-tokens 4``; on CPU a breadth of 1,
draft chains, which ``launch_server`` sets for k3 and which is passed to the others too). On a GPU
``--spec-args`` may name EAGLE or EAGLE3 with a draft model instead (the same flags reach all three
speculative servers; ``benchmarks/gpu_serving.sh spec`` with ``SPEC_ALGO`` builds one with
``sglang_k3.model.tiny_draft``). Workloads:

* ``multiturn``: ``--conversations`` chats taking turns, each turn the previous prompt + the server's
  greedy reply + new user tokens (``benchmarks.live.workloads.run_multiturn``);
* ``repeat``: ``--repeat-prompts`` fresh prompts, each sent twice in a row (a retry or a
  regenerate): NGRAM drafts the second answer from the first, and a cache serves the prompt.

Each server answers a warm-up prompt twice before the workloads (then its cache is flushed).
Reports per server and workload the token hit rate, the prompt tokens computed, the accept length
(tokens committed per verify step: accepted drafts plus the target's own token), output tokens/s,
TTFT p50/p90, and greedy mismatches against ``k3`` (none expected with fp32 checkpoints; int8 may
flip a few). A random-weight model rarely repeats itself, so on ``multiturn`` NGRAM accepts little:
the accept lengths here say what the verify path costs and keeps, not what a trained model gains.
Writes OUT/results.json, OUT/spec_ab.png and OUT/README.md (default ``benchmarks/results/spec_ab``).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import workloads as wl  # noqa: E402
from benchmarks.live.client import generate_stream, summarize_results  # noqa: E402
from benchmarks.live.report import bar_panel, write_report  # noqa: E402
from benchmarks.live_ab import git_info, machine_info  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "spec_ab")
NAMES = ("k3_spec", "k3", "upstream_spec", "off_spec")
CACHE_ARGS = {
    "k3_spec": [],
    "k3": [],
    "upstream_spec": ["--radix-cache-backend", "upstream"],
    "off_spec": ["--disable-radix-cache"],
}
DEFAULT_SPEC = "--speculative-algorithm NGRAM --speculative-num-draft-tokens 4 --speculative-ngram-max-bfs-breadth 1"
WORKLOADS = ("multiturn", "repeat")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wl.add_multiturn_args(p, conversations=4, turns=4, first_len=64, user_len=32, reply_len=32)
    p.add_argument("--repeat-prompts", type=int, default=6, help="prompts of the repeat workload (each sent twice)")
    p.add_argument("--repeat-len", type=int, default=160, help="tokens per repeat prompt")
    p.add_argument("--repeat-reply", type=int, default=48, help="greedy output tokens per repeat request")
    p.add_argument("--server-args", default="", help="launch_server flags for every server (default: none)")
    p.add_argument("--spec-args", default=DEFAULT_SPEC, help="flags of the speculative servers (default %(default)s)")
    p.add_argument("--only", default=",".join(NAMES), help=f"comma-separated subset of {', '.join(NAMES)}")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default %(default)s)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    wl.check_multiturn_args(p, a)
    if min(a.repeat_prompts, a.repeat_len, a.repeat_reply) < 1:
        p.error("--repeat-prompts, --repeat-len and --repeat-reply must be at least 1")
    a.only = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in a.only if n not in NAMES]
    if bad or not a.only:
        p.error(f"--only: choose from {', '.join(NAMES)} (got {a.only})")
    return a


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def algorithm(spec_args: str) -> str:
    """The ``--speculative-algorithm`` of ``spec_args`` (for titles)."""
    words = shlex.split(spec_args)
    for i, w in enumerate(words):
        if w.startswith("--speculative-algorithm="):
            return w.split("=", 1)[1]
        if w == "--speculative-algorithm" and i + 1 < len(words):
            return words[i + 1]
    return "?"


def server_args(name: str, args) -> list[str]:
    spec = shlex.split(args.spec_args) if name.endswith("_spec") else []
    return CACHE_ARGS[name] + shlex.split(args.server_args) + spec


def run_repeat(url: str, vocab: list[int], args) -> tuple[dict, dict]:
    """Each of ``--repeat-prompts`` seeded prompts twice in a row, one request at a time."""
    rng = random.Random(args.seed * 31 + 7)
    results = []
    t0 = time.perf_counter()
    for i in range(args.repeat_prompts):
        prompt = [rng.choice(vocab) for _ in range(args.repeat_len)]
        for k in range(2):
            res = generate_stream(url, f"repeat{i}/{k}", prompt, args.repeat_reply)
            results.append(res)
            if not args.quiet:
                _say(f"  [repeat] {res.key}: cached {res.cached_tokens} verifies {res.spec_verifies}")
    duration = time.perf_counter() - t0
    return summarize_results(results, duration), {r.key: r.output_ids for r in results if r.error is None}


def warm_up(srv, vocab: list[int]) -> None:
    """A prompt answered twice (the second time from accepted drafts), then a flush: first-use
    costs (on a GPU the verify's kernels compile at their first launch) stay out of the timings of
    whichever server runs first."""
    prompt = [vocab[(i * 7) % len(vocab)] for i in range(200)]
    for _ in range(2):
        srv.generate(prompt, 32)
    srv.flush_cache()


def _run_one(name: str, args, vocab: list[int], log_dir: str) -> tuple[dict, dict, list[str]]:
    from sglang_k3.fleet.instance import Server

    srv = Server(name, server_args(name, args), log_dir=log_dir, log_prefix="spec_ab").start()
    try:
        warm_up(srv, vocab)
        metrics, outputs = {}, {}
        m, o = wl.run_multiturn(
            srv.url, name, vocab, interleaved=True, verbose=not args.quiet, **wl.multiturn_kwargs(args)
        )
        metrics["multiturn"], outputs["multiturn"] = m, o
        metrics["repeat"], outputs["repeat"] = run_repeat(srv.url, vocab, args)
        return metrics, outputs, srv.args
    finally:
        srv.stop()


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("hit_rate", "token hit rate"), ("accept_length", "accept length"), ("output_tok_per_s", "output tok/s")]
    fig, axes = plt.subplots(len(WORKLOADS), len(panels), figsize=(4.0 * len(panels), 3.0 * len(WORKLOADS)))
    colors = {"k3_spec": "#1f77b4", "k3": "#aec7e8", "upstream_spec": "#ff7f0e", "off_spec": "#7f7f7f"}
    names = list(runs)
    for row, w in zip(axes, WORKLOADS):
        for ax, (metric, label) in zip(row, panels):
            bar_panel(ax, names, [runs[n]["metrics"][w][metric] or 0 for n in names], colors, f"{w}: {label}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(runs: dict) -> str:
    rows = [
        "| workload | server | hit rate | prompt tokens computed | accept length | output tok/s | TTFT p50 / p90 (s) "
        "| greedy mismatches vs k3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in WORKLOADS:
        for name, r in runs.items():
            m = r["metrics"][w]
            acc = "-" if m["accept_length"] is None else f"{m['accept_length']:.2f}"
            mism = r["mismatches"].get(w)
            mism = "-" if mism is None else f"{mism[0]} of {mism[1]}"
            rows.append(
                f"| {w} | {name} | {m['hit_rate']:.3f} | {m['prefill_tokens']:,} | {acc} | {m['output_tok_per_s']:.1f} "
                f"| {m['ttft_p50_s']:.2f} / {m['ttft_p90_s']:.2f} | {mism} |"
            )
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    from sglang_k3.model.tiny_build import default_model_path

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="spec_ab_")
    os.makedirs(args.out, exist_ok=True)
    vocab = wl.vocabulary(default_model_path())
    t0 = time.time()
    runs: dict = {}
    outputs: dict = {}
    for name in args.only:
        _say(f"spec_ab: {name} ...")
        metrics, outputs[name], sargs = _run_one(name, args, vocab, log_dir)
        runs[name] = {"metrics": metrics, "server_args": sargs}
        _say(
            f"spec_ab: {name}: "
            + ", ".join(f"{w} hit {metrics[w]['hit_rate']:.3f} accept {metrics[w]['accept_length']}" for w in WORKLOADS)
        )
    for name in runs:
        runs[name]["mismatches"] = {}
        if "k3" in outputs and name != "k3":
            for w in WORKLOADS:
                ref, got = outputs["k3"][w], outputs[name][w]
                keys = sorted(set(ref) & set(got))
                runs[name]["mismatches"][w] = (sum(ref[k] != got[k] for k in keys), len(keys))
    result = {
        "workloads": {
            "multiturn": wl.multiturn_kwargs(args) | {"interleaved": True},
            "repeat": {"prompts": args.repeat_prompts, "prompt_len": args.repeat_len, "reply_len": args.repeat_reply},
        },
        "server_args": args.server_args,
        "spec_args": args.spec_args,
        "runs": runs,
        "wall_s": time.time() - t0,
        "git": git_info(),
        "machine": machine_info(),
    }
    algo = algorithm(args.spec_args)
    title = f"{algo} ({args.spec_args}); every server: {args.server_args or 'defaults'}"
    plot(runs, os.path.join(args.out, "spec_ab.png"), title)
    write_report(args.out, "spec_ab", result, f"Speculative decoding ({algo}) with the k3 cache", title, _table(runs))
    print(_table(runs))
    _say(f"wrote {args.out}/results.json, spec_ab.png and README.md ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
