"""Greedy flips from restored checkpoints, by top-2 margin: ``python -m benchmarks.checkpoint_flips``.

A request restored from a quantized (int8/bf16) checkpoint continues from a state that differs
slightly from the exact one, so its logits move slightly. Greedy decoding only changes where that
movement is bigger than the gap between the two best tokens. This benchmark measures how often that
happens, and at which gaps, next to the gaps at which the server's own batching changes greedy
tokens:

1. A cache-off reference server (``--disable-radix-cache``) answers every prompt of a seeded
   workload one at a time ("alone"), with the top-2 logprobs at every output position. Its greedy
   replies also build the multi-turn prompts, so every condition sees the very same prompts.
2. Noise: the reference server answers the same prompts again in concurrent batches
   (``--batch-size`` requests in flight at once, batch mates drawn at random).
3. For each ``--dtypes`` entry, a fresh k3 server with ``--k3-checkpoint-dtype DTYPE`` answers the
   prompts one at a time in workload order. The workload repeats prompts, shares system prompts
   between different suffixes and continues conversations, so the first request of a group warms the
   cache and the later ones restore from checkpoints (``meta_info.cached_tokens`` > 0).

Per condition and request, the output is compared with the reference's ("alone") token by token.
At the first position where they differ (a flip), the margin is the reference's top-1 minus top-2
logprob there. Every position up to and including a request's first divergence is counted in the
margin bucket of its reference margin, so a bucket's rate = flips / positions with that margin. For
k3 conditions only restored requests are exposed (requests without a restore compute exactly what
the reference computes and are checked separately); for the noise condition every request is.

Writes ``OUT/results.json`` and ``OUT/checkpoint_flips.png`` and prints a table. Exit status: 0 ok;
1 a server failed; 3 finished, but fp32 checkpoints (bit-exact) or requests without a restore flipped.
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

from benchmarks.live.client import percentile  # noqa: E402  (imports requests only)

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "checkpoint_flips")
DEFAULT_LOGS = os.path.join(REPO, "benchmarks", "results", "tmp", "checkpoint_flips_logs")
DTYPES = ("int8", "bf16", "fp32")
NOISE = "batching noise"
DEFAULT_EDGES = (1e-4, 1e-3, 1e-2, 1e-1)
SCHEMA = "sglang_k3.checkpoint_flips/1"
KINDS = ("repeat", "shared", "turn")


# ----------------------------------------------------------------------------- margins and buckets
def parse_edges(text: str) -> list[float]:
    """``"1e-4,1e-3"`` -> ``[0.0001, 0.001]``; edges must be positive and strictly increasing."""
    edges = [float(x) for x in text.split(",") if x.strip()]
    if not edges or any(e <= 0 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"bucket edges must be positive and increasing, got {text!r}")
    return edges


def _sci(x: float) -> str:
    """``0.0001`` -> ``"1e-4"``, ``0.0025`` -> ``"2.5e-3"``, ``0.1`` -> ``"1e-1"``, ``2.0`` -> ``"2"``."""
    if x >= 1:
        return f"{x:g}"
    m, e = f"{x:e}".split("e")
    return f"{float(m):g}e{int(e)}"


def bucket_labels(edges) -> list[str]:
    """``[1e-4, 1e-3]`` -> ``["<1e-4", "1e-4..1e-3", ">=1e-3"]`` (a bucket is ``[lo, hi)``)."""
    f = _sci
    return (
        [f"<{f(edges[0])}"]
        + [f"{f(a)}..{f(b)}" for a, b in zip(edges, edges[1:], strict=False)]
        + [f">={f(edges[-1])}"]
    )


def bucket_index(margin: float, edges) -> int:
    """The bucket of ``margin``: 0 below ``edges[0]``, ``len(edges)`` at or above the last edge."""
    for i, e in enumerate(edges):
        if margin < e:
            return i
    return len(edges)


def top2_margin(top: list) -> float:
    """Top-1 minus top-2 logprob of one position's ``output_top_logprobs`` entry
    (``[[logprob, token_id, text], ...]``, best first); ``inf`` when only one candidate came back."""
    lps = sorted((t[0] for t in top if t[0] is not None), reverse=True)
    if len(lps) < 2:
        return math.inf
    return lps[0] - lps[1]


def first_divergence(a: list, b: list):
    """Index of the first position where the two token lists differ, ``None`` when they agree.
    A list that stops early diverges where it stops."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def parse_response(out: dict) -> dict:
    """The fields this benchmark keeps from one ``/generate`` answer (``return_logprob`` with
    ``top_logprobs_num`` >= 2)."""
    meta = out["meta_info"]
    tops = meta.get("output_top_logprobs") or []
    restore = meta.get("k3_restore_len")
    if isinstance(restore, list):
        restore = restore[0] if restore else None
    return {
        "output_ids": list(out["output_ids"]),
        "logprobs": [t[0] for t in meta.get("output_token_logprobs") or []],
        "margins": [top2_margin(t) for t in tops],
        "top2_ids": [[t[1] for t in top[:2]] for top in tops],
        "cached_tokens": int(meta.get("cached_tokens") or 0),
        "k3_restore_len": restore,
        "prompt_tokens": int(meta.get("prompt_tokens") or 0),
    }


def compare_request(ref: dict, other: dict, edges) -> dict:
    """One request of a condition against the reference: the first divergence, the reference's
    margin there, the margin bucket of every position counted (up to and including the first
    divergence) and the largest |logprob difference| of the chosen token on agreeing positions."""
    d = first_divergence(ref["output_ids"], other["output_ids"])
    n = len(ref["output_ids"]) if d is None else min(d + 1, len(ref["output_ids"]))
    margins = ref["margins"]
    counted = [bucket_index(margins[i], edges) for i in range(min(n, len(margins)))]
    agree = len(ref["output_ids"]) if d is None else d
    diffs = [
        abs(x - y)
        for x, y in zip(ref["logprobs"][:agree], other["logprobs"][:agree], strict=False)
        if x is not None and y is not None
    ]
    # how far the top-2 gap moved where both sides agree on the token and on the top-2 candidates
    shifts = [
        abs(other["margins"][i] - margins[i])
        for i in range(min(agree, len(margins), len(other["margins"])))
        if other["top2_ids"][i] == ref["top2_ids"][i]
        and math.isfinite(margins[i])
        and math.isfinite(other["margins"][i])
    ]
    margin = margins[d] if d is not None and d < len(margins) else None
    at = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    max_diff_at = (
        None
        if at is None
        else {
            "position": at,
            "ref_margin": margins[at] if at < len(margins) else None,
            "other_margin": other["margins"][at] if at < len(other["margins"]) else None,
            "ref_top2_ids": ref["top2_ids"][at] if at < len(ref["top2_ids"]) else None,
            "other_top2_ids": other["top2_ids"][at] if at < len(other["top2_ids"]) else None,
        }
    )
    return {
        "diverged_at": d,
        "margin": margin,
        "bucket": None if margin is None else bucket_index(margin, edges),
        "counted_buckets": counted,
        "max_abs_logprob_diff": max(diffs) if diffs else 0.0,
        "abs_logprob_diffs": diffs,
        "abs_margin_shifts": shifts,
        "max_diff_at": max_diff_at,
        "ref_token": ref["output_ids"][d] if d is not None and d < len(ref["output_ids"]) else None,
        "other_token": other["output_ids"][d] if d is not None and d < len(other["output_ids"]) else None,
        "ref_top2_ids": ref["top2_ids"][d] if d is not None and d < len(ref["top2_ids"]) else None,
    }


def wilson(k: int, n: int, z: float = 1.96):
    """95% Wilson score interval of ``k / n``; ``None`` when ``n`` is 0."""
    if n == 0:
        return None
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


def aggregate(comparisons: list[dict], edges) -> dict:
    """Per-condition numbers from :func:`compare_request` results that carry ``key``, ``kind``,
    ``exposed`` (restored, or batched for the noise) and ``output_len``. Rates are over exposed
    requests; flips of unexposed requests are counted apart (they should not happen)."""
    labels = bucket_labels(edges)
    exp = [c for c in comparisons if c["exposed"]]
    positions = [0] * len(labels)
    flips = [0] * len(labels)
    for c in exp:
        for b in c["counted_buckets"]:
            positions[b] += 1
        if c["diverged_at"] is not None and c["bucket"] is not None:
            flips[c["bucket"]] += 1
    n_flips = sum(c["diverged_at"] is not None for c in exp)
    n_pos = sum(positions)
    all_diffs = [x for c in exp for x in c["abs_logprob_diffs"]]
    worst = max((c for c in exp if c["abs_logprob_diffs"]), key=lambda c: c["max_abs_logprob_diff"], default=None)
    all_shifts = [x for c in exp for x in c["abs_margin_shifts"]]
    by_kind = {}
    for k in dict.fromkeys(c["kind"] for c in exp):
        ck = [c for c in exp if c["kind"] == k]
        by_kind[k] = {"requests": len(ck), "flips": sum(c["diverged_at"] is not None for c in ck)}
    lo = [0.0] + list(edges)
    hi = list(edges) + [None]
    return {
        "compared_requests": len(comparisons),
        "exposed_requests": len(exp),
        "exposed_output_positions": sum(c["output_len"] for c in exp),
        "flips": n_flips,
        "flip_rate": n_flips / len(exp) if exp else None,
        "flip_rate_ci95": wilson(n_flips, len(exp)),
        "positions_counted": n_pos,
        "per_position_flip_rate": n_flips / n_pos if n_pos else None,
        "buckets": [
            {
                "label": labels[i],
                "lo": lo[i],
                "hi": hi[i],
                "positions": positions[i],
                "flips": flips[i],
                "rate": flips[i] / positions[i] if positions[i] else None,
                "rate_ci95": wilson(flips[i], positions[i]),
            }
            for i in range(len(labels))
        ],
        "max_abs_logprob_diff_agreeing": max((c["max_abs_logprob_diff"] for c in exp), default=0.0),
        "max_abs_logprob_diff_where": (None if worst is None else {"key": worst["key"], **worst["max_diff_at"]}),
        "abs_logprob_diff_agreeing_p50": percentile(all_diffs, 50),
        "abs_logprob_diff_agreeing_p99": percentile(all_diffs, 99),
        "agreeing_positions": len(all_diffs),
        "abs_margin_shift_p50": percentile(all_shifts, 50),
        "abs_margin_shift_p99": percentile(all_shifts, 99),
        "abs_margin_shift_max": max(all_shifts, default=None),
        "margin_shift_positions": len(all_shifts),
        "by_kind": by_kind,
        "unexposed_requests": len(comparisons) - len(exp),
        "unexposed_flips": sum(c["diverged_at"] is not None for c in comparisons if not c["exposed"]),
        "flip_details": [
            {
                k: c[k]
                for k in (
                    "key",
                    "kind",
                    "diverged_at",
                    "margin",
                    "ref_token",
                    "other_token",
                    "ref_top2_ids",
                    "cached_tokens",
                    "exposed",
                )
            }
            for c in comparisons
            if c["diverged_at"] is not None
        ],
    }


# ----------------------------------------------------------------------------- workload
def make_workload(
    seed: int, n_requests: int, vocab: list, *, system_len=(96, 256), user_len=(8, 64), max_group=4
) -> list[dict]:
    """``n_requests`` requests in groups that share prefixes, groups interleaved at random (a
    group's requests keep their order). Kinds: ``repeat`` (one prompt sent twice: the second restores
    it whole), ``shared`` (one system prompt, 2..``max_group`` different user suffixes: later ones
    restore the system prompt), ``turn`` (a conversation of 2..``max_group`` turns: turn i's prompt
    = turn i-1's prompt + the reference's greedy reply + new user tokens). Each group has its own
    random system prompt. A request's prompt is ``base + user`` where ``base`` is ``("turn", key)``
    for a later turn (resolved by :func:`resolve_prompt`)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.choice(vocab) for _ in range(n)]  # noqa: E731
    groups: list[list[dict]] = []
    total = 0
    while total < n_requests:
        g = len(groups)
        kind = rng.choice(KINDS)
        system = tok(rng.randint(*system_len))
        if kind == "repeat":
            user = tok(rng.randint(*user_len))
            items = [{"kind": kind, "role": role, "base": system, "user": user} for role in ("first", "again")]
        elif kind == "shared":
            items = [
                {
                    "kind": kind,
                    "role": "first" if i == 0 else "branch",
                    "base": system,
                    "user": tok(rng.randint(*user_len)),
                }
                for i in range(rng.randint(2, max_group))
            ]
        else:
            items = []
            for i in range(rng.randint(2, max_group)):
                items.append(
                    {
                        "kind": kind,
                        "role": "first" if i == 0 else "next",
                        "base": system if i == 0 else ("turn", f"g{g}/{kind}{i - 1}"),
                        "user": tok(rng.randint(*user_len)),
                    }
                )
        items = items[: n_requests - total]
        for i, it in enumerate(items):
            it["key"] = f"g{g}/{it['kind']}{i}"
            it["group"] = g
        groups.append(items)
        total += len(items)
    order: list[dict] = []
    pending = [list(g) for g in groups]
    while any(pending):
        g = rng.choice([p for p in pending if p])
        order.append(g.pop(0))
    return order


def resolve_prompt(item: dict, prompts: dict, replies: dict) -> list:
    """The prompt token ids of ``item``; a later turn needs its previous turn's prompt and the
    reference's reply to it."""
    base = item["base"]
    if isinstance(base, tuple):
        prev = base[1]
        return prompts[prev] + replies[prev] + item["user"]
    return list(base) + item["user"]


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_flips",
        description=__doc__.split("\n\n")[0] + " Starts a cache-off reference server and one k3 server "
        "per checkpoint dtype (one at a time), compares greedy tokens with the reference's and sorts "
        "flips by the reference's top-2 margin, next to the flips of the reference's own batching.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the workload (prompts, group kinds, order, batch mates); kept in the JSON (default 1)",
    )
    g.add_argument("--requests", type=int, default=48, help="requests per condition (default 48)")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=24,
        help="greedy tokens per request (temperature 0, ignore_eos) (default 24)",
    )
    g.add_argument("--system-len", default="96,256", help="min,max tokens of a group's system prompt (default 96,256)")
    g.add_argument("--user-len", default="8,64", help="min,max tokens of a user suffix or turn (default 8,64)")
    g.add_argument(
        "--max-group",
        type=int,
        default=4,
        help="most requests in a 'shared' group and most turns in a conversation (default 4)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="noise condition: requests in flight at once on the reference server (default 8)",
    )
    g.add_argument("--no-noise", action="store_true", help="skip the batching-noise condition")
    g.add_argument(
        "--bucket-edges",
        default=",".join(f"{e:g}" for e in DEFAULT_EDGES),
        help="margin bucket edges, increasing (default 1e-4,0.001,0.01,0.1: buckets <1e-4, "
        "1e-4..1e-3, 1e-3..1e-2, 1e-2..1e-1, >=1e-1)",
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help=f"comma-separated k3 checkpoint dtypes to measure, each on a fresh server (default {','.join(DTYPES)})",
    )
    g.add_argument(
        "--server-args",
        default="",
        help='extra launch_server flags for every server, one shell-quoted string (e.g. "--model-path DIR")',
    )
    g.add_argument(
        "--k3-args", default="", help="extra flags for the k3 servers only (added after --k3-checkpoint-dtype DTYPE)"
    )
    g.add_argument(
        "--reference-url",
        default=None,
        help="use this running cache-off server as the reference instead of starting one",
    )
    g.add_argument(
        "--k3-url",
        action="append",
        default=[],
        metavar="DTYPE=URL",
        help="use this running k3 server for DTYPE instead of starting one (repeatable); its cache is flushed first",
    )
    g.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for a server's /health (default 600)"
    )
    g.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for results.json and checkpoint_flips.png (default {DEFAULT_OUT})"
    )
    g.add_argument("--log-dir", default=DEFAULT_LOGS, help=f"server logs (default {DEFAULT_LOGS}, git-ignored)")
    g.add_argument("--no-plot", action="store_true", help="write results.json only")
    g.add_argument(
        "--save-raw",
        action="store_true",
        help="also write OUT/raw.json: every condition's per-request output ids, chosen-token logprobs, "
        "top-2 margins and top-2 ids, cached tokens, and the prompts' lengths (for looking into one flip)",
    )
    g.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    return p


def _pair(p, name: str, text: str) -> tuple:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        p.error(f"--{name} takes min,max (two integers), got {text!r}")
    if a < 1 or b < a:
        p.error(f"--{name}: need 1 <= min <= max, got {text!r}")
    return a, b


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.requests < 2:
        p.error("--requests must be >= 2 (a prefix is restored on its second occurrence)")
    for name in ("max_new_tokens", "batch_size", "max_group"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_group < 2:
        p.error("--max-group must be >= 2")
    args.system_len = _pair(p, "system-len", args.system_len)
    args.user_len = _pair(p, "user-len", args.user_len)
    try:
        args.edges = parse_edges(args.bucket_edges)
    except ValueError as e:
        p.error(f"--bucket-edges: {e}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes: unknown {bad}; choose from {','.join(DTYPES)}")
    urls = {}
    for spec in args.k3_url:
        d, _, url = spec.partition("=")
        if d not in DTYPES or not url:
            p.error(f"--k3-url takes DTYPE=URL with DTYPE in {','.join(DTYPES)}, got {spec!r}")
        urls[d] = url.rstrip("/")
    args.k3_urls = urls
    return args


# ----------------------------------------------------------------------------- run
def _request(srv, prompt: list, args) -> dict:
    out = srv.generate(prompt, args.max_new_tokens, return_logprob=True, top_logprobs_num=2)
    return parse_response(out)


def _external(name: str, url: str):
    """A :class:`benchmarks.live.server.Server` handle for a server someone else started
    (``generate`` only needs ``url``; ``stop`` does nothing as no process was launched)."""
    from benchmarks.live.server import Server

    s = Server(name, [])
    s.url = url.rstrip("/")
    return s


def _k3_stats(url: str):
    import requests

    try:
        info = requests.get(url + "/server_info", timeout=30).json()
        return (info.get("internal_states") or [{}])[0].get("k3_cache")
    except Exception:  # noqa: BLE001 - informational only
        return None


def _flush(url: str) -> None:
    from benchmarks.live.server import flush_cache

    flush_cache(url)


def _fmt_margin(m) -> str:
    return "n/a" if m is None else f"{m:.1e}"


def run_condition(name: str, items: list, ref: dict, results: dict, edges) -> list[dict]:
    """Compare one condition's parsed results with the reference, request by request."""
    comps = []
    for it in items:
        k = it["key"]
        c = compare_request(ref[k], results[k], edges)
        c.update(
            key=k,
            kind=it["kind"],
            output_len=len(ref[k]["output_ids"]),
            cached_tokens=results[k]["cached_tokens"],
            exposed=(results[k]["cached_tokens"] > 0) if name != NOISE else True,
        )
        comps.append(c)
    return comps


def print_table(conditions: dict, labels: list) -> None:
    head = (
        f"{'condition':<15} {'exposed':>7} {'out pos':>7} {'flips':>5} {'rate':>6} {'per pos':>8} "
        f"{'max|dlp|':>9} {'p99|dgap|':>9} {'max|dgap|':>9}  " + "  ".join(f"{lb:>12}" for lb in labels)
    )
    print("\n" + head)
    for name, c in conditions.items():
        cells = "  ".join(f"{b['flips']:>4}/{b['positions']:<7}" for b in c["buckets"])
        rate = "n/a" if c["flip_rate"] is None else f"{c['flip_rate']:.3f}"
        pp = "n/a" if c["per_position_flip_rate"] is None else f"{c['per_position_flip_rate']:.4f}"
        print(
            f"{name:<15} {c['exposed_requests']:>7} {c['exposed_output_positions']:>7} {c['flips']:>5} {rate:>6} "
            f"{pp:>8} {c['max_abs_logprob_diff_agreeing']:>9.2e} {c['abs_margin_shift_p99'] or 0.0:>9.2e} "
            f"{c['abs_margin_shift_max'] or 0.0:>9.2e}  {cells}"
        )
    print(
        "(exposed = restored requests for k3, all requests for batching noise; rate = flipped / exposed requests; "
        "per pos = flips / positions counted up to each first divergence; |dlp| = |logprob difference| of the "
        "chosen token on agreeing positions; |dgap| = how far the top-2 margin moved there; bucket cells: "
        "flips/positions at that reference top-2 margin)"
    )


def plot(conditions: dict, labels: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(conditions)
    colors = {"int8": "#d62728", "bf16": "#ff7f0e", "fp32": "#2ca02c", NOISE: "#7f7f7f"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4), gridspec_kw={"width_ratios": [3, 1.6, 1.8]})
    width = 0.8 / max(1, len(names))
    ax = axes[0]
    top = max([b["rate"] or 0.0 for n in names for b in conditions[n]["buckets"]] + [0.01])
    for j, n in enumerate(names):
        bs = conditions[n]["buckets"]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(bs))]
        ys = [b["rate"] or 0.0 for b in bs]
        bars = ax.bar(xs, ys, width, label=n, color=colors.get(n))
        for bar, b in zip(bars, bs, strict=True):
            ax.annotate(
                f"{b['flips']}/{b['positions']}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90,
            )
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("reference (cache-off) top-1 minus top-2 logprob at the position")
    ax.set_ylabel("flip rate = first divergences / positions")
    ax.set_title("greedy flips by margin bucket (labels: flips/positions; 95% CIs in results.json)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[1]
    xs = list(range(len(names)))
    ys = [conditions[n]["flip_rate"] or 0.0 for n in names]
    bars = ax.bar(xs, ys, 0.6, color=[colors.get(n) for n in names])
    for bar, n in zip(bars, names, strict=True):
        c = conditions[n]
        ax.annotate(
            f"{c['flips']}/{c['exposed_requests']}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs)
    ax.set_xticklabels(names)
    ax.set_ylim(0, max(ys + [0.01]) * 1.25)
    ax.set_ylabel("flipped requests / exposed requests")
    ax.set_title("per request (k3: restored requests)", fontsize=10)
    ax = axes[2]
    for x, n in enumerate(names):
        c = conditions[n]
        vals = [c.get("abs_margin_shift_p50"), c.get("abs_margin_shift_p99"), c.get("abs_margin_shift_max")]
        if any(v is None or v <= 0 for v in vals):
            continue
        ax.bar(x, vals[1], 0.6, color=colors.get(n))
        ax.plot([x, x], [vals[0], vals[2]], color="black", lw=1)
        ax.plot([x], [vals[0]], marker="_", color="black", ms=12)
        ax.plot([x], [vals[2]], marker="_", color="black", ms=12)
        ax.annotate(f"{vals[1]:.1e}", (x, vals[1]), xytext=(3, 0), textcoords="offset points", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("|change of top-2 margin| on agreeing positions")
    ax.set_title("how far the margin moves: bar p99, line p50..max", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    from benchmarks import live_ab
    from benchmarks.live import workloads as wl
    from benchmarks.live.server import Server, ServerStartError

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    base = shlex.split(args.server_args)
    model_dir = None
    if "--model-path" in base:
        model_dir = base[base.index("--model-path") + 1]
    else:
        from sglang_k3.model.tiny_build import default_model_path

        model_dir = default_model_path()
    vocab = wl.vocabulary(model_dir)
    items = make_workload(
        args.seed, args.requests, vocab, system_len=args.system_len, user_len=args.user_len, max_group=args.max_group
    )
    kinds = {k: sum(it["kind"] == k for it in items) for k in KINDS}
    say(f"workload: {len(items)} requests (seed {args.seed}): {kinds}; {args.max_new_tokens} greedy tokens each")

    def make(name, extra):
        return Server(
            name, base + extra, start_timeout=args.start_timeout, log_dir=args.log_dir, log_prefix="checkpoint_flips"
        )

    ref_srv = (
        _external("reference", args.reference_url)
        if args.reference_url
        else make("reference", ["--disable-radix-cache"])
    )
    k3_args = {d: ["--k3-checkpoint-dtype", d, *shlex.split(args.k3_args)] for d in args.dtypes}
    started: list = []
    server_start_s: dict = {}
    prompts: dict = {}
    ref: dict = {}
    raw: dict = {}
    conditions: dict = {}
    k3_stats: dict = {}
    timings: dict = {}
    labels = bucket_labels(args.edges)

    def progress(label, i, n, key, res, comp=None):
        if args.quiet:
            return
        tail = ""
        if comp is not None:
            tail = (
                " same"
                if comp["diverged_at"] is None
                else f" FLIP at {comp['diverged_at']} (margin {_fmt_margin(comp['margin'])})"
            )
        print(
            f"  [{label}] {i}/{n} {key}: prompt {res['prompt_tokens']} cached {res['cached_tokens']}{tail} "
            f"({time.time() - t_start:.0f}s)",
            flush=True,
        )

    def boot(srv):
        say(f"  {srv.name}: {shlex.join(srv.command)}\n    log {srv.log_path}")
        srv.launch()
        started.append(srv)

    try:
        # the reference and the first k3 server boot at once; later k3 servers one at a time
        first_k3 = None
        if not args.reference_url:
            say("starting servers (20-60 s each on a CPU):")
            boot(ref_srv)
        pending = [d for d in args.dtypes if d not in args.k3_urls]
        if pending:
            first_k3 = make(f"k3_{pending[0]}", k3_args[pending[0]])
            boot(first_k3)
        if not args.reference_url:
            ref_srv.wait_healthy()
            server_start_s["reference"] = ref_srv.start_seconds
            say(f"  reference healthy after {ref_srv.start_seconds:.0f}s at {ref_srv.url}")
        if first_k3 is not None:  # wait now: its start timeout runs from its launch
            first_k3.wait_healthy()
            server_start_s[first_k3.name] = first_k3.start_seconds
            say(
                f"  {first_k3.name} healthy after {first_k3.start_seconds:.0f}s at {first_k3.url} (idle until its turn)"
            )

        # 1. reference, alone, in workload order (builds the multi-turn prompts)
        t0 = time.time()
        say(f"[reference alone] {len(items)} requests one at a time on {ref_srv.url}")
        for i, it in enumerate(items, 1):
            prompts[it["key"]] = resolve_prompt(it, prompts, {k: v["output_ids"] for k, v in ref.items()})
            ref[it["key"]] = _request(ref_srv, prompts[it["key"]], args)
            progress("reference alone", i, len(items), it["key"], ref[it["key"]])
        timings["reference_alone_s"] = time.time() - t0

        # 2. reference, batched
        if not args.no_noise:
            t0 = time.time()
            order = list(items)
            random.Random(args.seed * 7919 + 1).shuffle(order)
            batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
            say(f"[{NOISE}] {len(items)} requests in {len(batches)} concurrent batches of up to {args.batch_size}")
            batched: dict = {}
            done = 0
            with ThreadPoolExecutor(args.batch_size) as ex:
                for b in batches:
                    outs = list(ex.map(lambda it: _request(ref_srv, prompts[it["key"]], args), b))
                    for it, res in zip(b, outs, strict=True):
                        batched[it["key"]] = res
                        done += 1
                        progress(
                            NOISE, done, len(items), it["key"], res, compare_request(ref[it["key"]], res, args.edges)
                        )
            raw[NOISE] = batched
            conditions[NOISE] = aggregate(run_condition(NOISE, items, ref, batched, args.edges), args.edges)
            timings["noise_s"] = time.time() - t0

        # 3. one k3 server per dtype
        for d in args.dtypes:
            t0 = time.time()
            if d in args.k3_urls:
                srv = _external(f"k3_{d}", args.k3_urls[d])
                _flush(srv.url)
            else:
                srv = first_k3 if (first_k3 is not None and first_k3.name == f"k3_{d}") else make(f"k3_{d}", k3_args[d])
                if srv.proc is None:
                    boot(srv)
                    srv.wait_healthy()
                    server_start_s[srv.name] = srv.start_seconds
                    say(f"  {srv.name} healthy after {srv.start_seconds:.0f}s at {srv.url}")
                elif not srv.alive():
                    raise RuntimeError(f"server {srv.name} died while idle:\n{srv.log_tail()}")
            name = d
            say(f"[{name}] {len(items)} requests one at a time on a fresh k3 server ({d} checkpoints)")
            res: dict = {}
            for i, it in enumerate(items, 1):
                res[it["key"]] = _request(srv, prompts[it["key"]], args)
                progress(
                    name,
                    i,
                    len(items),
                    it["key"],
                    res[it["key"]],
                    compare_request(ref[it["key"]], res[it["key"]], args.edges),
                )
            k3_stats[d] = _k3_stats(srv.url)
            if srv.proc is not None:
                if not srv.alive():
                    raise RuntimeError(f"server {srv.name} died:\n{srv.log_tail()}")
                srv.stop()
            raw[name] = res
            agg = aggregate(run_condition(name, items, ref, res, args.edges), args.edges)
            agg["restored_output_positions"] = agg["exposed_output_positions"]
            agg["restored_prompt_tokens"] = sum(r["cached_tokens"] for r in res.values())
            agg["prompt_tokens"] = sum(len(p) for p in prompts.values())
            agg["k3_restore_len_reported"] = sum(r["k3_restore_len"] is not None for r in res.values())
            conditions[name] = agg
            timings[f"{name}_s"] = time.time() - t0
            if agg["exposed_requests"] == 0:
                say(f"WARNING: no {d} request restored from a checkpoint; the workload exercised nothing")
    except (ServerStartError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s in started:
            s.stop()

    # conditions in plot/table order: dtypes, then noise
    ordered = {d: conditions[d] for d in args.dtypes if d in conditions}
    if NOISE in conditions:
        ordered[NOISE] = conditions[NOISE]
    runtime = time.time() - t_start
    result = {
        "schema": SCHEMA,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.checkpoint_flips " + shlex.join(sys.argv[1:] if argv is None else argv),
        "runtime_s": runtime,
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
            "batch_size": None if args.no_noise else args.batch_size,
            "bucket_edges": args.edges,
            "bucket_labels": labels,
            "model": model_dir,
            "server_args": {
                "reference": ref_srv.args if not args.reference_url else f"external {args.reference_url}",
                **{
                    f"k3_{d}": (k3_args[d] if d not in args.k3_urls else f"external {args.k3_urls[d]}")
                    for d in args.dtypes
                },
            },
            "common_server_args": base,
            "server_start_s": server_start_s,
            "sampling": {"temperature": 0.0, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": 2},
            "reference": "cache-off server (--disable-radix-cache), one request at a time, workload order",
            "margin": "reference top-1 minus top-2 logprob at the position",
            "exposed": "k3: requests with meta_info.cached_tokens > 0 (restored from a checkpoint); "
            f"{NOISE}: every request (batched, {args.batch_size} in flight, random batch mates)",
            "positions_counted": "each exposed request's output positions up to and including its first divergence",
        },
        "workload": {
            "kinds": kinds,
            "prompt_tokens": sum(len(p) for p in prompts.values()),
            "requests": [
                {"key": it["key"], "kind": it["kind"], "role": it["role"], "prompt_len": len(prompts[it["key"]])}
                for it in items
            ],
        },
        "conditions": ordered,
        "k3_cache_stats": k3_stats,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.save_raw:
        with open(os.path.join(args.out, "raw.json"), "w") as f:
            json.dump(
                {
                    "seed": args.seed,
                    "reference": ref,
                    "conditions": raw,
                    "prompt_lens": {k: len(v) for k, v in prompts.items()},
                },
                f,
            )
    if not args.no_plot and ordered:
        plot(
            ordered,
            labels,
            os.path.join(args.out, "checkpoint_flips.png"),
            f"greedy flips vs cache-off reference, by top-2 margin (seed {args.seed}, {len(items)} requests x "
            f"{args.max_new_tokens} tokens, {time.strftime('%Y-%m-%d')})",
        )
    print_table(ordered, labels)
    print(
        f"\nwrote {os.path.join(args.out, 'results.json')}"
        + ("" if args.no_plot else " and checkpoint_flips.png")
        + f" in {runtime:.0f}s",
        flush=True,
    )
    bad = []
    if "fp32" in ordered and ordered["fp32"]["flips"]:
        bad.append(f"fp32 checkpoints (bit-exact) flipped {ordered['fp32']['flips']} requests")
    for n, c in ordered.items():
        if c["unexposed_flips"]:
            bad.append(f"{n}: {c['unexposed_flips']} requests without a restore flipped")
    if bad:
        print("WARNING: " + "; ".join(bad), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
