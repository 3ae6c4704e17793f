"""``python -m benchmarks.tier_host_bytes``: the host-bytes comparison with upstream's hybrid host
tier is computed from the pool shapes (checked here against the cost model's own sizes) and, for
a replay run with a host tier, from what that tier held."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_trace_replay import REPO, synthetic_trace

from sglang_k3.cache import preset


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )


def test_curve_and_a_replays_host_tier(tmp_path):
    trace = tmp_path / "t.jsonl"
    synthetic_trace(trace, seed=5)
    rep = tmp_path / "replay"
    r = _cli(
        "benchmarks.trace_replay",
        "--trace",
        str(trace),
        "--policies",
        "k3",
        "--budgets-gib",
        "0.25",
        "--host-budget-gib",
        "0.5",
        "--out",
        str(rep),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "hb"
    r = _cli("benchmarks.tier_host_bytes", "--replay", str(rep / "results.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert (out / "tier_host_bytes.png").stat().st_size > 0
    cost = preset("kimi-linear-48b")
    k, up, ours = cost.kv_bytes_per_token(), cost.checkpoint_bytes("fp32"), cost.checkpoint_bytes("int8")
    assert (res["kv_bytes_per_token"], res["state_bytes_upstream"], res["state_bytes_k3_int8"]) == (k, up, ours)
    ratios = [c["ratio_upstream_over_k3"] for c in res["curve"]]
    assert all(a > b > 1 for a, b in zip(ratios, ratios[1:]))  # denser states: a larger saving
    c512 = next(c for c in res["curve"] if c["tokens_per_state"] == 512)
    assert c512["upstream_bytes_per_token"] == pytest.approx(k + up / 512)
    (point,) = res["replays"]
    assert point["states"] > 0 and point["cached_tokens"] > 0
    span = point["tokens_per_state"]
    assert point["ratio_upstream_over_k3"] == pytest.approx((k * span + up) / (k * span + ours), rel=1e-6)
    # upstream's host pools split as its device pools do: 1 / 1.9 of its bytes hold KV
    assert res["upstream_host_bytes_per_token_at_split"] == pytest.approx(k * 1.9)
    assert point["ratio_at_upstream_split"] == pytest.approx(k * 1.9 * span / (k * span + ours), rel=1e-6)


def test_a_replay_without_a_host_tier_is_refused_or_skipped(tmp_path):
    r = _cli("benchmarks.tier_host_bytes", "--replay", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no such file" in r.stderr
