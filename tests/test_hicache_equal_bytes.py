"""``benchmarks.hicache_equal_bytes``: bad input is refused with the reason, and a small run writes
one row per member, host size and device budget, with the ratio taken from the same run."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import hicache_equal_bytes, trace_replay


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--host-gib", "0"], "positive sizes"),
        (["--members", "nope"], "unknown member"),
        (["--budgets-gib", "ten"], "comma-separated numbers"),
    ],
)
def test_bad_input_is_refused_with_the_reason(argv, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        hicache_equal_bytes.main(argv + ["--out", str(tmp_path)])


@pytest.mark.skipif(not os.path.exists(trace_replay.DEFAULT_TRACE), reason="the shipped trace is not here")
def test_a_small_run_writes_every_row_from_one_replay(tmp_path):
    out = tmp_path / "out"
    argv = ["--members", "conversation", "--conversation-requests", "200", "--budgets-gib", "2,8"]
    assert hicache_equal_bytes.main(argv + ["--host-gib", "16", "--jobs", "1", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["host_gib"], r["device_gib"]) for r in res["rows"]] == [(16, 2), (16, 8)]
    by = {(r["policy"], r["budget_gib"]): r for r in res["records"]}
    for row in res["rows"]:
        k3, hc = by[("k3", row["device_gib"])], by[("upstream-hicache", row["device_gib"])]
        assert row["k3_over_hicache"] == pytest.approx(k3["hit_rate"] / hc["hit_rate"])
        assert hc["host_budget_gib"] == k3["host_budget_gib"] == 16  # equal host bytes
        # the host tier only adds hits: HiCache restores at least what the device alone does
        assert row["upstream_hicache"] >= row["upstream_device_only"] > 0
    assert (out / "README.md").read_text().count("| conversation | 16 |") == 2
    assert (out / "hicache_equal_bytes.png").stat().st_size > 0
