"""The cache step-cost micro-benchmark (``python -m benchmarks.cache_step_cost``) at tiny sizes:
its output says what it measured, as many steps as asked, with positive finite times, over
trees of about the size asked, with eviction running in the timed steps. No assertion on speed:
the targets live in the benchmark's notes, not in a timed test."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import cache_step_cost as csc

SIZES = (1000, 3000)
STEPS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("sglang")
    out = tmp_path_factory.mktemp("cache_step_cost")
    argv = [
        "--sizes",
        ",".join(map(str, SIZES)),
        "--steps",
        str(STEPS),
        "--warm",
        "8",
        "--seed",
        "3",
        "--calibration-rounds",
        "2",
        "--calibration-window",
        "20",
        "--profile-steps",
        "3",
        "--out",
        str(out),
    ]
    results = csc.main(argv)
    return out, results


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_it_writes_json_and_a_plot(run):
    out, results = run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["steps"] == STEPS and on_disk["seed"] == 3 and on_disk["sizes"] == list(SIZES)
    assert set(on_disk["systems"]) == {"k3", "upstream"}
    png = (out / "step_cost.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert results["steps"] == on_disk["steps"]


@pytest.mark.parametrize("system", ["k3", "upstream"])
def test_every_size_has_the_steps_asked_with_positive_finite_times(run, system):
    _, results = run
    rows = results["systems"][system]
    assert [r["size_target_tokens"] for r in rows] == list(SIZES)
    parts = csc.PARTS_K3 if system == "k3" else csc.PARTS_UP
    for r in rows:
        assert r["steps"] == STEPS
        for summary in (r["step"], r["step_cpu"]):
            assert summary["n"] == STEPS
            for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"):
                assert _finite_positive(summary[k]), (system, k, summary[k])
            assert summary["p50_ms"] <= summary["p99_ms"] <= summary["max_ms"]
        assert set(r["parts"]) == set(parts)
        for name, p in r["parts"].items():
            assert p["n"] == STEPS
            assert math.isfinite(p["mean_ms"]) and p["mean_ms"] >= 0, name
        assert _finite_positive(r["parts"]["match"]["mean_ms"]) and _finite_positive(r["parts"]["insert"]["mean_ms"])
        # the parts are exclusive times that add up to the step
        total = sum(p["mean_ms"] for p in r["parts"].values())
        assert total == pytest.approx(r["step"]["mean_ms"], rel=1e-6)


@pytest.mark.parametrize("system", ["k3", "upstream"])
def test_the_tree_reaches_the_size_asked_and_evicts_while_timed(run, system):
    _, results = run
    for r in results["systems"][system]:
        size = r["size_target_tokens"]
        # k3's ledger moves KV in blocks of one int8 checkpoint's bytes (~1,500 tokens at 48B),
        # so a tree of a few thousand tokens lands within a factor, not a percentage
        assert 0.4 * size <= r["tree_tokens"] <= 2.0 * size, (system, size, r["tree_tokens"])
        lo, hi = r["tree_tokens_min_max"]
        assert lo <= r["tree_tokens"] <= hi
        assert r["tree_nodes"] >= 2 and r["tree_checkpoints"] >= 1
        assert r["steps_that_evicted"] >= STEPS // 2, (system, size, r["steps_that_evicted"])
        assert 0 < r["token_hit_rate"] < 1


def test_k3_budget_and_upstream_core_are_recorded(run):
    _, results = run
    for r in results["systems"]["k3"]:
        assert r["budget_bytes"] > 0 and r["calibration"] and r["ledger"]["num_blocks"] > 0
    assert results["config"]["k3"]["k3_config"]["unified_memory"] is True
    up = results["config"]["upstream"]
    assert results["upstream_status"]["available"] is True
    assert up["tree_core_backend"] == "python" and up["tree_core_class"] == "UnifiedTreeCore"


def test_scaling_fits_and_profile_are_reported(run):
    _, results = run
    for system in ("k3", "upstream"):
        sc = results["scaling"][system]
        assert sc["fit_log"]["model"].endswith("ln(n)") and math.isfinite(sc["fit_log"]["b"])
        assert math.isfinite(sc["fit_linear"]["b"]) and math.isfinite(sc["loglog_slope"])
        assert isinstance(sc["grows_no_faster_than_log_n"], bool)
        prof = results["systems"][system][-1]["profile"]
        assert prof["steps"] == 3 and prof["top_cumulative"]
        assert all(_finite_positive(e["cumtime_ms_per_step"]) for e in prof["top_cumulative"][:5])


def test_help_says_what_is_measured(capsys):
    with pytest.raises(SystemExit) as e:
        csc.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "scheduling step" in text and "--sizes" in text and "perf_counter_ns" in text


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        csc.parse_args(["--sizes", "10"])
    with pytest.raises(SystemExit):
        csc.parse_args(["--sizes", "1000,x"])
