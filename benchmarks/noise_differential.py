"""A noise-aware differential of the cache: ``python -m benchmarks.noise_differential``.

Greedy equality with a cache-off server is the oracle on CPU in fp32. In bf16 on a GPU it is not:
two cache-off servers that differ only in how they split a prefill already disagree on about a
quarter of greedy continuations of a random-weight model. So this harness measures that noise in the
same run and judges the cache against it.

Servers (started at once, or with ``--stagger`` the reference first; each waits idle,
``--sleep-on-idle``, until its turn):

* ``reference``: cache off (``--disable-radix-cache``);
* ``split``: cache off, ``--chunked-prefill-size SPLIT`` (another prefill split);
* one per candidate: ``fp32`` / ``int8`` / ``bf16`` (k3 with ``--k3-checkpoint-dtype D``) and
  ``upstream`` (SGLang's own hybrid cache at its defaults, ``--radix-cache-backend upstream``);
* ``--corrupt D``: one more k3 server (``D`` checkpoints) whose first restored state is negated on
  purpose (``tests/faults/sitecustomize.py``), to show the harness flags a restore that is really
  wrong.

Workload: :func:`benchmarks.checkpoint_flips.make_workload` (seeded; repeats, shared system prompts
with different suffixes, multi-turn conversations whose next prompt carries the reference's greedy
reply), so every server sees the very same prompts.

1. The reference answers every request alone, in workload order (this builds the prompts).
2. The noise floor, from cache-off servers only: ``split`` answers the same prompts alone, in order
   (split floor), and the reference answers them again in concurrent batches of ``--batch-size``
   with random batch mates (batch floor).
3. Each candidate answers them alone, in workload order, on a fresh cache: later requests of a group
   restore what earlier ones left (``meta_info.cached_tokens`` > 0).

Per request, the first output token (the one the restored state feeds) is compared with the
reference's: **drift** = the larger |logprob difference| of the reference's top-1 and top-2 tokens
(infinite when the reference's top-1 is not among the other side's top ``--top-k``). A restored
request meets both noises at once (its prefix was computed inside another request's prefill, its
suffix in an extend of its own), so a request's floor is its split drift plus its batch drift, and
``tau`` is the largest floor of the run. A candidate is **within the floor** when none of its
restored requests drifts more than ``FLAG_FACTOR * tau``, an order of magnitude beyond what noise
alone reached (such a request is *flagged*). Whether its restored drifts as a whole sit above the
floor's (one-sided Mann-Whitney U, p < ``MW_ALPHA``) is reported beside it. Greedy flips over the
whole reply are also sorted by the reference's top-2 margin (:func:`benchmarks.checkpoint_flips.aggregate`), so a
quantized checkpoint's excess over the floor shows per margin bucket.

4. States (unless ``--no-states``): every state a k3 candidate restored is compared with the state the
   reference computes for the same tokens, against the same two noises measured on states plus what
   the checkpoint codec loses by design (:mod:`benchmarks.live.state_probe`). On a GPU in bf16 the
   first-token drift could not tell a negated state from noise (benchmarks/GPU_NOTES.md, fifth
   session); the states are the check for that.

Writes ``OUT/results.json`` and ``OUT/noise_differential.png``. Exit status: 0 ok; 1 a server failed;
3 finished, but an fp32 candidate was not within the floor (tokens or states), or ``--corrupt`` was
flagged at neither level.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a file too
    sys.path.insert(0, REPO)

from benchmarks import checkpoint_flips as cf  # noqa: E402
from benchmarks.live import state_probe as sp  # noqa: E402
from benchmarks.live.client import percentile  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "noise_differential")
DEFAULT_LOGS = os.path.join(REPO, "benchmarks", "results", "tmp", "noise_differential_logs")
FAULTS_DIR = sp.FAULTS_DIR
CANDIDATES = ("fp32", "int8", "bf16", "upstream")
SPLIT, BATCH = "split floor", "batch floor"
# A restored request is flagged when it drifts more than FLAG_FACTOR times the largest floor of the
# run: an order of magnitude, since noise scales with the logits, so a factor, not an offset. At 4x,
# exact fp32 restores were flagged on CPU in a run of 8 requests (4.75x a floor of 16 draws): the
# largest of a few draws is a noisy scale. MW_ALPHA: the one-sided p below which a candidate's
# drifts count as larger than the floor's as a whole.
FLAG_FACTOR = 10.0
MW_ALPHA = 1e-3
SCHEMA = "sglang_k3.noise_differential/1"


# ----------------------------------------------------------------------------- first-token drift
def first_token(out: dict, top_k: int) -> dict:
    """The first output position's top-``top_k`` logprobs, ``{token_id: logprob}`` best first."""
    tops = (out["meta_info"].get("output_top_logprobs") or [[]])[0] or []
    return {int(t[1]): float(t[0]) for t in tops[:top_k] if t[0] is not None}


def drift(ref_top: dict, other_top: dict) -> float:
    """The larger |logprob difference| of the reference's top-1 and top-2 tokens; ``inf`` when the
    reference's top-1 is not among ``other_top``. A reference top-2 token missing on the other side
    is skipped (it may sit just below the other's top-k cut)."""
    ranked = list(ref_top)
    if not ranked:
        return math.nan
    if ranked[0] not in other_top:
        return math.inf
    return max(abs(ref_top[t] - other_top[t]) for t in ranked[:2] if t in other_top)


def mann_whitney_greater(x: list, y: list) -> float:
    """One-sided p of the Mann-Whitney U test that ``x`` is stochastically larger than ``y``
    (normal approximation with a tie correction; ``inf`` values rank highest). 1.0 when either
    side is empty or every value ties."""
    x = [v for v in x if not math.isnan(v)]
    y = [v for v in y if not math.isnan(v)]
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        return 1.0
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y], key=lambda p: p[0])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, pooled, strict=True) if g == 0)
    u1 = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return 1.0
    z = (u1 - n1 * n2 / 2 - 0.5) / math.sqrt(var)  # continuity correction
    return 0.5 * math.erfc(z / math.sqrt(2))


def _finite_max(values: list):
    v = [x for x in values if not math.isnan(x)]
    return max(v) if v else None


def summarize_drifts(values: list) -> dict:
    v = [x for x in values if not math.isnan(x)]
    fin = [x for x in v if math.isfinite(x)]
    return {
        "n": len(v),
        "p50": percentile(fin, 50),
        "p90": percentile(fin, 90),
        "max": _finite_max(v),
        "infinite": len(v) - len(fin),
    }


def request_floors(split: list, batch: list) -> list:
    """Per request, the split drift plus the batch drift (``[{"key", "drift"}]`` each, same keys):
    the two noises a restored request meets at once."""
    b = {d["key"]: d["drift"] for d in batch}
    return [d["drift"] + b[d["key"]] for d in split]


def judge(candidate: list, floor: list, *, factor: float = FLAG_FACTOR, alpha: float = MW_ALPHA) -> dict:
    """``candidate``: ``[(key, drift)]`` of its restored requests; ``floor``: every floor drift.
    Within the floor: at least one restored request and none flagged (drift > ``factor`` * max
    floor drift). ``stochastically_larger`` (one-sided Mann-Whitney p < ``alpha``) says whether the
    drifts as a whole sit above the floor's; it is reported, not gated on: a restored request's
    prefill is split at the restore point and batched differently at once, two noise sources the
    floor measures one at a time, so even exact fp32 restores drift a little more than either."""
    tau = _finite_max(floor)
    if tau is None:
        raise ValueError("no floor drifts measured")
    limit = factor * tau
    flagged = [k for k, d in candidate if not math.isnan(d) and d > limit]
    p = mann_whitney_greater([d for _, d in candidate], floor)
    return {
        "tau": tau,
        "flag_limit": limit,
        "flagged": flagged,
        "mann_whitney_p": p,
        "restored_requests": len(candidate),
        "within_floor": bool(candidate) and not flagged,
        "stochastically_larger": p < alpha,
    }


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.noise_differential",
        description=__doc__.split("\n\n")[0] + " Starts cache-off reference and split servers and one "
        "server per candidate, and judges each candidate's first-token logprobs against the noise of the "
        "cache-off servers in the same run.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload")
    g.add_argument("--seed", type=int, default=1, help="workload seed, kept in the JSON (default 1)")
    g.add_argument("--requests", type=int, default=48, help="requests per condition (default 48)")
    g.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens per request (default 8)")
    g.add_argument("--system-len", default="96,256", help="min,max tokens of a group's system prompt (default 96,256)")
    g.add_argument("--user-len", default="8,64", help="min,max tokens of a user suffix or turn (default 8,64)")
    g.add_argument("--max-group", type=int, default=4, help="most requests of a group (default 4)")
    g.add_argument("--batch-size", type=int, default=8, help="batch floor: requests in flight at once (default 8)")
    g.add_argument("--top-k", type=int, default=5, help="top logprobs returned per position (default 5)")
    g.add_argument(
        "--bucket-edges",
        default=",".join(f"{e:g}" for e in cf.DEFAULT_EDGES),
        help="top-2 margin bucket edges for the greedy flips (default 1e-4,0.001,0.01,0.1)",
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--candidates",
        default="fp32,int8,upstream",
        help=f"comma-separated servers to judge, from {','.join(CANDIDATES)} (default fp32,int8,upstream)",
    )
    g.add_argument(
        "--corrupt",
        choices=("fp32", "int8", "bf16"),
        default=None,
        help="also run a k3 server with these checkpoints whose first restored state is corrupted on purpose "
        "(condition DTYPE_corrupt; the run fails unless it is flagged)",
    )
    g.add_argument(
        "--split",
        type=int,
        default=128,
        help="--chunked-prefill-size of the split-floor server (the others keep the default) (default 128)",
    )
    g.add_argument(
        "--server-args",
        default="",
        help='extra launch_server flags for every server, one shell-quoted string (e.g. "--model-path DIR")',
    )
    g.add_argument("--k3-args", default="", help="extra flags for the k3 servers only")
    g.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="use this running server for NAME (reference, split or a candidate) instead of starting one "
        "(repeatable); a candidate's cache is flushed first. The corrupted server is always started here.",
    )
    g.add_argument(
        "--stagger",
        action="store_true",
        help="start the reference alone, let it answer the workload, then start the rest: on a GPU its "
        "Triton kernels, compiled per shape as it meets them, are then in the on-disk cache for the others "
        "(all at once, each server compiled them itself, 1-8 s per kernel on the H200)",
    )
    g.add_argument(
        "--no-states",
        action="store_true",
        help="judge tokens only: do not load the state probes (tests/faults/sitecustomize.py) into the servers "
        "or compare restored states with the reference's (they need the reference and split servers started here)",
    )
    g.add_argument(
        "--keep-states",
        action="store_true",
        help="keep the probed state files (LOG_DIR/states/SERVER/*.pt, megabytes each on a real model); "
        "by default they are deleted once judged, their distances being in results.json",
    )
    g.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for /health (default 900)")
    g.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    g.add_argument("--log-dir", default=DEFAULT_LOGS, help=f"server logs (default {DEFAULT_LOGS}, git-ignored)")
    g.add_argument("--no-plot", action="store_true", help="write results.json only")
    g.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.requests < 2:
        p.error("--requests must be >= 2 (a prefix is restored on its second occurrence)")
    for name in ("max_new_tokens", "batch_size", "split"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_group < 2:
        p.error("--max-group must be >= 2")
    if args.top_k < 2:
        p.error("--top-k must be >= 2 (the drift reads the top-2 tokens)")
    args.system_len = cf._pair(p, "system-len", args.system_len)
    args.user_len = cf._pair(p, "user-len", args.user_len)
    try:
        args.edges = cf.parse_edges(args.bucket_edges)
    except ValueError as e:
        p.error(f"--bucket-edges: {e}")
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    bad = [c for c in args.candidates if c not in CANDIDATES]
    if bad or (not args.candidates and not args.corrupt):
        p.error(f"--candidates: unknown {bad}; choose from {','.join(CANDIDATES)}")
    urls = {}
    for spec in args.url:
        name, _, url = spec.partition("=")
        if name not in ("reference", "split", *args.candidates) or not url:
            p.error(f"--url takes NAME=URL with NAME reference, split or one of --candidates, got {spec!r}")
        urls[name] = url.rstrip("/")
    args.urls = urls
    if args.corrupt and not sp.available():
        p.error(f"--corrupt needs {FAULTS_DIR}/sitecustomize.py (a source checkout)")
    args.states_skipped = None
    if args.no_states:
        args.states_skipped = "--no-states"
    elif not sp.available():
        args.states_skipped = f"no {FAULTS_DIR}/sitecustomize.py (a source checkout has it)"
    elif {"reference", "split"} & set(urls):
        args.states_skipped = "the reference or split server was given by --url (its states cannot be read)"
    return args


def corrupt_name(args):
    return f"{args.corrupt}_corrupt" if args.corrupt else None


def server_specs(args) -> dict:
    """name -> (extra launch flags, extra environment) of every server this run starts."""
    k3 = shlex.split(args.k3_args)
    specs = {
        "reference": (["--disable-radix-cache"], None),
        "split": (["--disable-radix-cache", "--chunked-prefill-size", str(args.split)], None),
    }
    for c in args.candidates:
        if c == "upstream":
            specs[c] = (["--radix-cache-backend", "upstream"], None)
        else:
            specs[c] = (["--k3-checkpoint-dtype", c, *k3], None)
    if args.corrupt:
        env = sp.hooks_env({"SGLANG_K3_TEST_CORRUPT_RESTORE": "1"})
        specs[corrupt_name(args)] = (["--k3-checkpoint-dtype", args.corrupt, *k3], env)
    if not args.states_skipped:
        root = os.path.join(args.log_dir, "states")
        for n, (extra, env) in list(specs.items()):
            if n != "upstream" and n not in args.urls:
                specs[n] = (extra, sp.server_env(root, n, env))
    return specs


def state_dir(specs: dict, name: str):
    env = specs.get(name, (None, None))[1] or {}
    return env.get(sp.STATE_DIR_ENV)


def candidate_dtype(args, name: str) -> str:
    return args.corrupt if name == corrupt_name(args) else name


# ----------------------------------------------------------------------------- run
def _request(srv, prompt: list, args) -> tuple[dict, dict]:
    out = srv.generate(prompt, args.max_new_tokens, return_logprob=True, top_logprobs_num=args.top_k)
    return cf.parse_response(out), first_token(out, args.top_k)


def condition(name: str, items: list, ref: dict, ref_top: dict, got: dict, got_top: dict, edges, floor: bool) -> dict:
    """One condition against the reference: per-request drift and greedy-flip comparison."""
    comps, drifts = [], []
    for it in items:
        k = it["key"]
        c = cf.compare_request(ref[k], got[k], edges)
        restored = got[k]["cached_tokens"] > 0
        c.update(
            key=k,
            kind=it["kind"],
            output_len=len(ref[k]["output_ids"]),
            cached_tokens=got[k]["cached_tokens"],
            exposed=True if floor else restored,
        )
        comps.append(c)
        drifts.append(
            {
                "key": k,
                "kind": it["kind"],
                "restored": restored,
                "cached_tokens": got[k]["cached_tokens"],
                "drift": drift(ref_top[k], got_top[k]),
            }
        )
    agg = cf.aggregate(comps, edges)
    for a in ("abs_logprob_diffs", "abs_margin_shifts"):
        agg.pop(a, None)
    exposed = [d["drift"] for d in drifts if floor or d["restored"]]
    unexposed = [d["drift"] for d in drifts if not floor and not d["restored"]]
    return {
        "name": name,
        "greedy": agg,
        "drift": summarize_drifts(exposed),
        "drift_unrestored": summarize_drifts(unexposed),
        "requests": drifts,
        "restored_prompt_tokens": sum(got[it["key"]]["cached_tokens"] for it in items),
    }


def judge_states(args, items, conds, restores, prompts, servers, specs) -> dict:
    """Step 4: each k3 candidate's restored states against the reference's, per restore point."""
    picked: dict = {}  # candidate -> [{"key", "cached_tokens", "file", "restores"}]
    unmatched: dict = {}
    for n, per_key in restores.items():
        cached = {d["key"]: d for d in conds[n]["requests"]}
        rows = []
        for it in items:
            k, files = it["key"], per_key.get(it["key"], [])
            if not cached[k]["restored"]:
                continue
            if not files:  # a hit whose state was not restored through the stores (counted, not judged)
                unmatched[n] = unmatched.get(n, 0) + 1
                continue
            row = {"key": k, "cached_tokens": cached[k]["cached_tokens"], "file": files[0], "restores": len(files)}
            rows.append(row)
        picked[n] = rows
    points = sorted({(r["key"], r["cached_tokens"]) for rows in picked.values() for r in rows})
    folders = {n: state_dir(specs, n) for n in ("reference", "split")}
    if not args.quiet:
        print(f"  [states] {len(points)} restore points: prefilled on the reference and split servers", flush=True)
    refs = sp.reference_states(points, prompts, servers, folders, args.batch_size, args.seed)
    verdicts = {n: sp.judge_states(rows, refs, candidate_dtype(args, n), judge) for n, rows in picked.items()}
    for n, v in verdicts.items():
        v["hits_without_a_store_restore"] = unmatched.get(n, 0)
    return {"skipped": None, "points": len(points), "verdicts": verdicts}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = result["conditions"]
    names = list(conds)
    sv = (result.get("states") or {}).get("verdicts") or {}
    ratios = [1.3, 1.7] + ([1.0] if sv else [])
    fig, axes = plt.subplots(1, len(ratios), figsize=(15 + 5 * bool(sv), 4.8), gridspec_kw={"width_ratios": ratios})
    ax = axes[0]
    tau = result["floor"]["tau"]
    # an infinite tau (a request's top-1 left the other side's top-k) cannot set a log scale: the
    # largest finite floor drift does, and the lines say so
    finite = [d["drift"] for n in (SPLIT, BATCH) for d in conds[n]["requests"] if math.isfinite(d["drift"])]
    floor_max = max(tau if math.isfinite(tau) else max(finite, default=1.0), 1e-12)
    for x, n in enumerate(names):
        c = conds[n]
        is_floor = n in (SPLIT, BATCH)
        vals = [d["drift"] for d in c["requests"] if (is_floor or d["restored"]) and not math.isnan(d["drift"])]
        cap = floor_max * 1e4
        shown = [min(max(v, floor_max * 1e-4), cap) for v in vals]
        jit = random.Random(x)
        ax.scatter(
            [x + jit.uniform(-0.25, 0.25) for _ in shown], shown, s=9, color="#7f7f7f" if is_floor else "#1f77b4"
        )
    if math.isfinite(tau):
        ax.axhline(floor_max, color="black", lw=1, ls="--", label=f"tau = largest split + batch drift ({tau:.2e})")
        ax.axhline(FLAG_FACTOR * floor_max, color="#d62728", lw=1, ls=":", label=f"flag limit ({FLAG_FACTOR:g} tau)")
    else:
        label = f"largest finite floor drift ({floor_max:.2e}); tau = inf"
        ax.axhline(floor_max, color="black", lw=1, ls="--", label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("first-token drift (|dlogprob| of ref top-1/top-2)")
    ax.set_title("drift per request (candidates: restored requests; 0 drawn at the bottom, inf at the top)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    labels = result["config"]["bucket_labels"]
    width = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        bs = conds[n]["greedy"]["buckets"]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(bs))]
        ax.bar(xs, [b["rate"] or 0.0 for b in bs], width, label=n)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("reference top-1 minus top-2 logprob at the position")
    ax.set_ylabel("greedy flips / positions")
    ax.set_title("greedy flips by margin bucket", fontsize=9)
    ax.legend(fontsize=7)
    if sv:
        ax = axes[2]
        tiny = min([r["drift"] for v in sv.values() for r in v["requests"] if r["drift"] > 0] + [1e-9]) / 10
        for x, v in enumerate(sv.values()):
            vals = [max(r["drift"], tiny) for r in v["requests"]]
            jit = random.Random(x)
            ax.scatter([x + jit.uniform(-0.25, 0.25) for _ in vals], vals, s=9, color="#1f77b4")
            if v.get("flag_limit") is not None:
                ax.hlines(v["flag_limit"], x - 0.4, x + 0.4, color="#d62728", lw=1, ls=":")
                ax.hlines(v["tau"], x - 0.4, x + 0.4, color="black", lw=1, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(sv)))
        ax.set_xticklabels(list(sv), rotation=20, fontsize=8)
        ax.set_ylabel("restored state: |dstate| / |state| against the reference")
        ax.set_title("states (dashed: tau = split + batch + codec; dotted: flag limit)", fontsize=9)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Stopped(Exception):
    """A driver's SIGTERM (its ``timeout``): stop the servers, keep the conditions that finished."""


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    import signal

    # a `timeout` or Ctrl-C from a driver stops the servers this run started on the way out (the
    # finally below), not only the harness: servers left behind hold GPU memory for the next run
    def _stop(*_):
        raise _Stopped("stopped by SIGTERM")

    signal.signal(signal.SIGTERM, _stop)
    from benchmarks import live_ab
    from benchmarks.live import workloads as wl
    from benchmarks.live.server import Server, ServerStartError

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    base = shlex.split(args.server_args)
    if "--model-path" in base:
        model_dir = base[base.index("--model-path") + 1]
    else:
        from sglang_k3.model.tiny_build import default_model_path

        model_dir = default_model_path()
    vocab = wl.vocabulary(model_dir)
    items = cf.make_workload(
        args.seed, args.requests, vocab, system_len=args.system_len, user_len=args.user_len, max_group=args.max_group
    )
    say(f"workload: {len(items)} requests (seed {args.seed}); {args.max_new_tokens} greedy tokens each")
    specs = server_specs(args)
    servers = {
        n: cf._external(n, args.urls[n])
        if n in args.urls
        else Server(
            n,
            base + ["--sleep-on-idle", *extra],
            start_timeout=args.start_timeout,
            log_dir=args.log_dir,
            log_prefix="noise_differential",
            env=env,
        )
        for n, (extra, env) in specs.items()
    }
    started = [s for n, s in servers.items() if n not in args.urls]
    prompts: dict = {}
    restores: dict = {}  # candidate -> key -> the restore-*.pt files its request added
    state_results: dict = {"skipped": args.states_skipped}
    ref: dict = {}
    ref_top: dict = {}
    conds: dict = {}
    stats: dict = {}
    timings: dict = {}
    try:
        first = [s for s in started if s.name == "reference"] if args.stagger else started
        rest = [s for s in started if s not in first]

        def boot(group: list) -> None:
            say(f"starting {len(group)} servers at once: {', '.join(s.name for s in group)}")
            for s in group:
                s.launch()
                say(f"  {s.name}: {shlex.join(s.command)}\n    log {s.log_path}")
            for s in group:
                s.wait_healthy()
                say(f"  {s.name} healthy after {s.start_seconds:.0f}s")

        boot(first)
        if not args.stagger:
            for n in args.urls:
                if n not in ("reference", "split"):
                    cf._flush(servers[n].url)
        timings["start_s"] = time.time() - t_start

        def alone(name: str, srv) -> tuple[dict, dict]:
            got, tops = {}, {}
            folder = state_dir(specs, name) if name not in ("reference", "split") else None  # their probes: step 4
            log = sp.RestoreLog(folder) if folder else None
            for i, it in enumerate(items, 1):
                if name == "reference":
                    prompts[it["key"]] = cf.resolve_prompt(it, prompts, {k: v["output_ids"] for k, v in got.items()})
                got[it["key"]], tops[it["key"]] = _request(srv, prompts[it["key"]], args)
                if log is not None:  # one request at a time: the restores it adds are its own
                    restores.setdefault(name, {})[it["key"]] = log.new()
                if not args.quiet and (i % 16 == 0 or i == len(items)):
                    print(f"  [{name}] {i}/{len(items)} ({time.time() - t_start:.0f}s)", flush=True)
            if srv.name not in args.urls and not srv.alive():
                raise RuntimeError(f"server {srv.name} died:\n{srv.log_tail()}")
            return got, tops

        t0 = time.time()
        ref, ref_top = alone("reference", servers["reference"])
        timings["reference_s"] = time.time() - t0
        if args.stagger:  # the reference has met every shape: the rest find its compiled kernels
            t0 = time.time()
            boot(rest)
            for n in args.urls:
                if n not in ("reference", "split"):
                    cf._flush(servers[n].url)
            timings["start_rest_s"] = time.time() - t0
        t0 = time.time()
        got, tops = alone("split", servers["split"])
        conds[SPLIT] = condition(SPLIT, items, ref, ref_top, got, tops, args.edges, floor=True)
        timings["split_s"] = time.time() - t0
        t0 = time.time()
        order = list(items)
        random.Random(args.seed * 7919 + 1).shuffle(order)
        got, tops = {}, {}
        with ThreadPoolExecutor(args.batch_size) as ex:
            for b in range(0, len(order), args.batch_size):
                chunk = order[b : b + args.batch_size]
                outs = list(ex.map(lambda it: _request(servers["reference"], prompts[it["key"]], args), chunk))
                for it, (res, top) in zip(chunk, outs, strict=True):
                    got[it["key"]], tops[it["key"]] = res, top
        conds[BATCH] = condition(BATCH, items, ref, ref_top, got, tops, args.edges, floor=True)
        timings["batch_s"] = time.time() - t0
        for n in [*args.candidates, *([corrupt_name(args)] if args.corrupt else [])]:
            t0 = time.time()
            got, tops = alone(n, servers[n])
            conds[n] = condition(n, items, ref, ref_top, got, tops, args.edges, floor=False)
            stats[n] = cf._k3_stats(servers[n].url) if n != "upstream" else None
            timings[f"{n}_s"] = time.time() - t0
            if n not in args.urls:
                servers[n].stop()  # frees its memory for the next
        if not args.states_skipped:
            t0 = time.time()
            state_results = judge_states(args, items, conds, restores, prompts, servers, specs)
            timings["states_s"] = time.time() - t0
            if not args.keep_states:
                import shutil

                shutil.rmtree(os.path.join(args.log_dir, "states"), ignore_errors=True)
    except (ServerStartError, RuntimeError, OSError, _Stopped) as e:
        # what finished is kept: a condition is judged only against a floor measured in this run
        print(f"error: {e}", file=sys.stderr)
        failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    else:
        failure = None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for s in started:
            s.stop()
    if SPLIT not in conds or BATCH not in conds:
        if failure:
            print("error: the noise floor was not measured; nothing written", file=sys.stderr)
        return 124 if failure and failure.startswith("_Stopped") else 1

    floor = request_floors(conds[SPLIT]["requests"], conds[BATCH]["requests"])
    verdicts = {}
    for n in conds:
        if n in (SPLIT, BATCH):
            continue
        restored = [(d["key"], d["drift"]) for d in conds[n]["requests"] if d["restored"]]
        verdicts[n] = judge(restored, floor)
    runtime = time.time() - t_start
    result = {
        "schema": SCHEMA,
        "title": f"noise-aware differential (seed {args.seed}, {len(items)} requests x {args.max_new_tokens} "
        f"tokens, {time.strftime('%Y-%m-%d')})",
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.noise_differential " + shlex.join(sys.argv[1:] if argv is None else argv),
        "runtime_s": runtime,
        "partial": failure,
        "timings_s": timings,
        "machine": live_ab.machine_info(),
        "git": live_ab.git_info(),
        "config": {
            "seed": args.seed,
            "requests": args.requests,
            "max_new_tokens": args.max_new_tokens,
            "system_len": list(args.system_len),
            "user_len": list(args.user_len),
            "max_group": args.max_group,
            "batch_size": args.batch_size,
            "top_k": args.top_k,
            "split": args.split,
            "bucket_edges": args.edges,
            "bucket_labels": cf.bucket_labels(args.edges),
            "flag_factor": FLAG_FACTOR,
            "mann_whitney_alpha": MW_ALPHA,
            "model": model_dir,
            "common_server_args": base,
            "servers": {
                n: (
                    {"external": args.urls[n]}
                    if n in args.urls
                    else {"args": s.args, "env": specs[n][1], "start_s": s.start_seconds}
                )
                for n, s in servers.items()
            },
            "drift": "first output token: max |logprob difference| of the reference's top-1 and top-2 tokens; "
            "inf when the reference's top-1 is not in the other side's top-k",
        },
        "workload": {
            "prompt_tokens": sum(len(p) for p in prompts.values()),
            "requests": [{"key": it["key"], "kind": it["kind"], "prompt_len": len(prompts[it["key"]])} for it in items],
        },
        "floor": {"tau": _finite_max(floor), **{k: v for k, v in summarize_drifts(floor).items() if k != "max"}},
        "verdicts": verdicts,
        "states": state_results,
        "conditions": conds,
        "k3_cache_stats": stats,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not args.no_plot:
        plot(result, os.path.join(args.out, "noise_differential.png"))
    print(
        f"\nfloor: tau {result['floor']['tau']:.3e}, the largest split + batch drift of {result['floor']['n']} requests"
    )
    print(f"{'condition':<14} {'restored':>8} {'drift p50':>10} {'p90':>10} {'max':>10} {'flips':>6} verdict")
    for n, c in conds.items():
        d, g = c["drift"], c["greedy"]
        v = verdicts.get(n)
        verdict = (
            ""
            if v is None
            else ("within floor" if v["within_floor"] else f"OUTSIDE ({len(v['flagged'])} flagged)")
            + f"; MW p {v['mann_whitney_p']:.1e}"
        )
        fmt = lambda x: "n/a" if x is None else f"{x:.2e}"  # noqa: E731
        print(
            f"{n:<14} {d['n']:>8} {fmt(d['p50']):>10} {fmt(d['p90']):>10} {fmt(d['max']):>10} {g['flips']:>6} {verdict}"
        )
    print(f"wrote {os.path.join(args.out, 'results.json')} in {runtime:.0f}s", flush=True)
    if failure:
        missing = [n for n in [*args.candidates, *([corrupt_name(args)] if args.corrupt else [])] if n not in conds]
        print(f"error: partial results ({failure}); not measured: {', '.join(missing)}", file=sys.stderr)
        return 124 if failure.startswith("_Stopped") else 1
    sv = state_results.get("verdicts") or {}
    if state_results.get("skipped"):
        print(f"states: not compared ({state_results['skipped']})")
    elif sv:
        print(f"\nstates ({state_results['points']} restore points; floor = split + batch + codec, per request)")
        print(f"{'condition':<14} {'judged':>8} {'tau':>10} {'drift max':>10} verdict")
        for n, v in sv.items():
            worst = max((r["drift"] for r in v["requests"]), default=None)
            tau = v.get("tau")
            fmt = lambda x: "n/a" if x is None else f"{x:.2e}"  # noqa: E731
            verdict = "within floor" if v["within_floor"] else f"OUTSIDE ({len(v.get('flagged', []))} flagged)"
            print(f"{n:<14} {v['restored_requests']:>8} {fmt(tau):>10} {fmt(worst):>10} {verdict}")
    bad = []
    if "fp32" in verdicts and not verdicts["fp32"]["within_floor"]:
        bad.append("fp32 checkpoints are not within the floor")
    if "fp32" in sv and not sv["fp32"]["within_floor"]:
        bad.append("fp32 restored states are not within the state floor")
    cn = corrupt_name(args)
    if args.corrupt and not verdicts[cn]["flagged"] and not (sv.get(cn) or {}).get("flagged"):
        bad.append("the corrupted restore was not flagged")
    if bad:
        print("WARNING: " + "; ".join(bad), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
