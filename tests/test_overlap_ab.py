"""``python -m benchmarks.overlap_ab`` (the overlap scheduler on vs off for the k3 server): clear
CLI errors, and one small end-to-end run whose JSON ratios are computed from its own runs and
whose two servers return the same greedy tokens."""

from __future__ import annotations

import functools
import json
import math

from server_utils import check_cli, run_benchmark

_run = functools.partial(run_benchmark, "benchmarks.overlap_ab")


def test_help_and_bad_flags():
    refused = ((["--conversations", "0"], "--conversations"),)
    check_cli("benchmarks.overlap_ab", ("--conversations", "--repeats"), refused)


def test_overlap_ab_end_to_end(tmp_path):
    out = tmp_path / "out"
    args = ["--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet", "--repeats", "2"]
    args += ["--conversations", "2", "--turns", "2", "--system-len", "64", "--first-len", "32"]
    args += ["--user-len", "16", "--reply-len", "4", "--server-args", "--k3-checkpoint-dtype fp32"]
    r = _run(args, 900)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    res = json.loads((out / "results.json").read_text())
    assert (out / "overlap_ab.png").stat().st_size > 0
    srv = res["servers"]
    assert "--disable-overlap-schedule" in srv["no_overlap"]["command"]
    assert "--disable-overlap-schedule" not in srv["overlap"]["command"]
    for name in ("overlap", "no_overlap"):
        runs = srv[name]["runs"]
        assert [r["round"] for r in runs] == [0, 1]
        for r in runs:
            assert r["requests"] == 4 and r["errors"] == 0 and r["output_tokens"] == 16
        mean = srv[name]["mean"]["output_tok_per_s"]
        assert math.isclose(mean, sum(r["output_tok_per_s"] for r in runs) / 2)
    a, b = srv["overlap"]["mean"], srv["no_overlap"]["mean"]
    assert math.isclose(
        res["ratios_overlap_over_no_overlap"]["output_tok_per_s"], a["output_tok_per_s"] / b["output_tok_per_s"]
    )
    assert res["greedy"] == {"compared": 4, "mismatches": []}
    # the second turn of each chat extends the first, so both hit (the first turns arrive
    # together, and whether the later one hits the shared system prompt depends on timing):
    # of 2 x 96 + 2 x 116 = 424 prompt tokens, each second turn restores its first turn's
    # generation end, 96 + 3 tokens (the last reply token is never fed)
    assert a["hit_rate"] >= 2 * 99 / 424 and b["hit_rate"] >= 2 * 99 / 424
