"""The fleet in simulated time: N instances, each the replay's ``k3`` policy (the real cache tree
and lifecycle, its own device budget and host tier), optionally one L3 store they all share, and a
router model (:mod:`benchmarks.fleet.routing`) in front.

Time model, per instance as in ``benchmarks/trace_replay.py``: one prefill engine, first come
first served; a request's prefill starts at ``max(arrival, engine free)`` and takes its FLOPs over
the rate, plus any tier load time; decode runs beside it. Events are applied in time order and
never early: before request ``i`` is routed, every instance applies the finishes (prompt + output
into its cache, and through write-through into the shared L3) due by ``i``'s arrival; the chosen
instance then applies its own finishes due by the request's start. So a boundary one instance
writes reaches another's lookup no earlier than it would in real time (at worst, later by that
instance's queueing delay).

The router sees, per instance, the requests it routed there and that have not finished (its load).
"""

from __future__ import annotations

import math
import time
from array import array
from heapq import heappop, heappush
from typing import Callable, Optional, Sequence


def sessions_of(trace) -> list[int]:
    """Each request's session: the first turn of its conversation (following ``trace.parent``)."""
    root: list[int] = []
    for i, p in enumerate(trace.parent):
        root.append(i if p < 0 else root[p])
    return root


def _pct(vals: Sequence[float], q: float) -> float:
    s = sorted(vals)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def replay_fleet(
    policies: list,
    routing,
    trace,
    cost,
    rate_flops: float,
    tpot_s: float,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    n = len(policies)
    sessions = sessions_of(trace)
    engine_free = [0.0] * n
    heaps: list[list] = [[] for _ in range(n)]
    loads = [0] * n
    per_req = [0] * n
    per_prompt = [0] * n
    per_hit = [0] * n
    ttft = array("d")
    t0 = time.perf_counter()

    def drain(k: int, until: float) -> None:
        h = heaps[k]
        while h and h[0][0] <= until:
            _, j, ctx = heappop(h)
            policies[k].finish(trace, j, ctx)
            loads[k] -= 1

    for i in range(len(trace)):
        arrival = trace.arrival_s[i]
        for k in range(n):
            drain(k, arrival)
        prompt = trace.prompt(i)
        k = routing.route(i, prompt, sessions[i], loads) if n > 1 else 0
        start = max(arrival, engine_free[k])
        drain(k, start)
        adm = policies[k].admit(trace, i)
        L = trace.input_len[i]
        d = cost.prefill_flops(adm.hit_tokens, L) / rate_flops + adm.load_s
        engine_free[k] = start + d
        ttft.append(engine_free[k] - arrival)
        heappush(heaps[k], (engine_free[k] + trace.output_len[i] * tpot_s, i, adm.ctx))
        loads[k] += 1
        per_req[k] += 1
        per_prompt[k] += L
        per_hit[k] += adm.hit_tokens
        if progress is not None and (i + 1) % 200 == 0:
            progress(200)
    for k in range(n):
        drain(k, math.inf)
    if progress is not None:
        progress(len(trace) % 200)
    req, hit = sum(per_prompt), sum(per_hit)
    tier_tokens: dict[str, int] = {}
    for p in policies:
        if getattr(p, "tiers", None) is not None:
            for name, v in p.tiers.hit_tokens_by_tier.items():
                tier_tokens[name] = tier_tokens.get(name, 0) + v
    unit = trace.unit
    return {
        "requests": len(trace),
        "prompt_tokens": req,
        "hit_tokens": hit,
        "hit_rate": hit / req if req else 0.0,
        "prefill_tokens": req - hit,
        # tier loads count prefix symbols; the replay's tokens are symbols x unit
        "host_hit_tokens": tier_tokens.get("host", 0) * unit,
        "l3_hit_tokens": tier_tokens.get("l3", 0) * unit,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "instance_requests": per_req,
        "instance_hit_rates": [h / p if p else 0.0 for h, p in zip(per_hit, per_prompt)],
        "request_imbalance": max(per_req) / max(1, min(per_req)),
        "replay_wall_s": time.perf_counter() - t0,
    }
