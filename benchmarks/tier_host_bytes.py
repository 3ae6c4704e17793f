"""Host bytes per cached token: k3's host tier against upstream's hybrid host tier, computed.

    python -m benchmarks.tier_host_bytes [--model-config kimi-linear-48b]
        [--replay benchmarks/results/trace_replay_tiers/host200/results.json ...]
        [--out benchmarks/results/tier_host_bytes]

Upstream's hybrid HiCache cannot run on CPU, so its size is computed from its pool shapes, as
SGLang 0.5.23 builds them (read from the installed sources, ``sglang/srt/``):

* its MLA host pool holds ``(kv_lora_rank + qk_rope_head_dim) x MLA layers x dtype`` bytes per
  token (``mem_cache/pool_host/mla.py``), the same KV bytes k3's tier holds;
* its ``MambaPoolHost`` slot is one full state for every KDA layer in the device pool's own dtypes
  (``mem_cache/pool_host/mamba.py``: temporal fp32, conv bf16 by ``configs/mamba_utils.py``), and
  a backed-up node carries at most one, at its end (``unified_cache/components/mamba.py``:
  "One state per node, valid only at the node's end boundary"); int8 checkpoints are refused
  together with HiCache (``arg_groups/mamba_hook.py``);
* so for cached prefixes with one state per ``L`` tokens it holds ``K + S_fp32 / L`` bytes per
  token; k3 holds ``K + S_int8 / L`` plus its object headers.

Two views: the curve over ``L`` (tokens per kept state), and, for each replay result given, the
host tier's content at the end of that run (its KV bytes and its states, so its own ``L``), priced
both ways: the same prefixes with the same states, held by upstream. Writes OUT/results.json and
OUT/tier_host_bytes.png.

A third number per replay, ``ratio_at_upstream_split``: upstream does not size its two host pools
by what they hold. ``--hicache-size`` is split between the MLA host pool and ``MambaPoolHost`` in
proportion to the device pools (``mem_cache/hybrid_cache/hybrid_pool_assembler.py::
_split_hicache_size``), and the device state pool gets ``ratio / (1 + ratio)`` of the memory
(``mamba_full_memory_ratio``, 0.9 by default: ``--upstream-mamba-ratio``, as in the trace replay).
So each host byte upstream spends holds at most ``1 / (1 + ratio)`` of a byte of KV: full, its
host tier costs ``K x (1 + ratio)`` per cached token, whatever states it keeps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from sglang_k3.cache import PRESETS, preset  # noqa: E402
from sglang_k3.tiers.codec import HEADER_BYTES  # noqa: E402
from sglang_k3.tiers.keys import BLOCK_TOKENS  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "tier_host_bytes")
SPANS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def tail_tokens(span: int, block: int = BLOCK_TOKENS) -> float:
    """Mean KV tokens a boundary object carries past its last whole block, for states every
    ``span`` tokens: ``pos mod block`` averaged over the positions. Those tokens' KV is also in
    the block object a later boundary writes, so k3 holds it twice (0 when ``span`` is a multiple
    of the block)."""
    n = block // math.gcd(int(span), block)  # the positions' residues repeat every n states
    return sum((i * int(span)) % block for i in range(1, n + 1)) / n


def per_token(k: int, state: int, span: float, headers: bool) -> float:
    extra = HEADER_BYTES * (1 / BLOCK_TOKENS + 1 / span) if headers else 0.0
    return k + state / span + extra + k * tail_tokens(int(span)) / span


def from_replay(path: str, k: int, s_up: int, s_k3: int, ratio: float) -> list[dict]:
    out = []
    with open(path) as f:
        records = json.load(f)
    for r in records:
        t = r.get("tiers")
        if not t or not t.get("tier_host_bytes"):
            continue
        held, state = t["tier_host_bytes"], t.get("tier_host_state_bytes")
        if state is None:
            raise SystemExit(f"{path}: no tier_host_state_bytes (re-run the replay with this version)")
        kv = held - state
        tokens, states = kv / k, state / s_k3
        up = kv + states * s_up
        out.append(
            {
                "replay": os.path.relpath(path, REPO),
                "policy": r["policy"],
                "budget_gib": r["budget_gib"],
                "host_budget_gib": r.get("host_budget_gib"),
                "cached_tokens": tokens,
                "states": states,
                "tokens_per_state": tokens / states if states else None,
                "k3_bytes_per_token": held / tokens,
                "upstream_bytes_per_token": up / tokens,
                "ratio_upstream_over_k3": up / held,
                "ratio_at_upstream_split": k * (1 + ratio) * tokens / held,
            }
        )
    return out


def plot(curve: list[dict], points: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [c["tokens_per_state"] for c in curve]
    a.plot(xs, [c["upstream_bytes_per_token"] / 1024 for c in curve], "s--", color="gray", label="upstream")
    a.plot(xs, [c["k3_bytes_per_token"] / 1024 for c in curve], "o-", label="k3 (int8)")
    b.plot(xs, [c["ratio_upstream_over_k3"] for c in curve], "o-", label="computed")
    for p in points:
        b.scatter([p["tokens_per_state"]], [p["ratio_upstream_over_k3"]], color="red", zorder=3)
        b.annotate(f"replay {p['budget_gib']:g} GiB", (p["tokens_per_state"], p["ratio_upstream_over_k3"]), fontsize=7)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens per kept state")
    a.set_ylabel("host KiB per cached token")
    a.set_yscale("log")
    b.set_ylabel("upstream / k3")
    b.axhline(3.0, color="black", lw=0.8, ls=":")
    a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tier_host_bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-config", default="kimi-linear-48b", choices=sorted(PRESETS))
    ap.add_argument("--replay", action="append", default=[], help="a trace replay results.json with tiers (repeatable)")
    ap.add_argument(
        "--upstream-mamba-ratio",
        type=float,
        default=0.9,
        help="upstream's mamba_full_memory_ratio: its host tier splits as its device pools do (default 0.9)",
    )
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for p in args.replay:
        if not os.path.isfile(p):
            ap.error(f"--replay: no such file: {p}")
    cost = preset(args.model_config)
    k = cost.kv_bytes_per_token("bf16")
    s_up, s_k3 = cost.checkpoint_bytes("fp32", "bf16"), cost.checkpoint_bytes("int8", "bf16")
    curve = []
    for span in SPANS:
        up, ours = per_token(k, s_up, span, False), per_token(k, s_k3, span, True)
        curve.append(
            {
                "tokens_per_state": span,
                "upstream_bytes_per_token": up,
                "k3_bytes_per_token": ours,
                "ratio_upstream_over_k3": up / ours,
            }
        )
    if args.upstream_mamba_ratio <= 0:
        ap.error("--upstream-mamba-ratio must be > 0")
    points = [p for path in args.replay for p in from_replay(path, k, s_up, s_k3, args.upstream_mamba_ratio)]
    os.makedirs(args.out, exist_ok=True)
    res = {
        "model_config": args.model_config,
        "kv_bytes_per_token": k,
        "state_bytes_upstream": s_up,
        "state_bytes_k3_int8": s_k3,
        "upstream_mamba_ratio": args.upstream_mamba_ratio,
        "upstream_host_bytes_per_token_at_split": k * (1 + args.upstream_mamba_ratio),
        "curve": curve,
        "replays": points,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(curve, points, os.path.join(args.out, "tier_host_bytes.png"), f"host tier bytes, {args.model_config}")
    print(f"K {k} B/token; state {s_up / 1e6:.1f} MB upstream (fp32 + bf16 conv), {s_k3 / 1e6:.1f} MB k3 int8")
    for c in curve:
        print(
            f"1 state / {c['tokens_per_state']:>5} tokens: upstream {c['upstream_bytes_per_token'] / 1024:8.1f} KiB, "
            f"k3 {c['k3_bytes_per_token'] / 1024:7.1f} KiB, {c['ratio_upstream_over_k3']:.2f}x"
        )
    for p in points:
        print(
            f"{p['replay']} {p['budget_gib']:g} GiB: {p['tokens_per_state']:.0f} tokens/state, "
            f"k3 {p['k3_bytes_per_token'] / 1024:.1f} KiB vs upstream {p['upstream_bytes_per_token'] / 1024:.1f}: "
            f"{p['ratio_upstream_over_k3']:.2f}x; at upstream's pool split {p['ratio_at_upstream_split']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
