"""``python -m benchmarks.noise_differential``: the drift and the verdict on constructed data, the
Mann-Whitney test against SciPy's, the state probes' distances, its command line, and one real run
on CPU whose restore is corrupted on purpose (``tests/faults/sitecustomize.py``): the harness must
flag it, by its tokens and by its state, and must not flag exact fp32 restores. The fp32 candidate
is the session's ``k3`` server; the reference, the split-floor server and the corrupted one are
started by the run (the state probes need them started with the hooks loaded)."""

from __future__ import annotations

import json
import math
import os
import random
import sys

import pytest
from server_utils import check_cli, run_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import noise_differential as nd  # noqa: E402
from benchmarks.live import state_probe as sp  # noqa: E402


def _out(tops):
    """A ``/generate`` answer whose first position has these ``(logprob, token_id)`` candidates."""
    return {"meta_info": {"output_top_logprobs": [[[lp, t, None] for lp, t in tops]]}}


# ----------------------------------------------------------------------------- pure functions
def test_first_token_keeps_the_top_k_in_order():
    top = nd.first_token(_out([(-0.1, 7), (-2.0, 3), (-3.0, 9)]), top_k=2)
    assert top == {7: -0.1, 3: -2.0} and list(top) == [7, 3]
    assert nd.first_token({"meta_info": {}}, top_k=5) == {}


def test_drift_reads_the_references_top_two():
    ref = {7: -0.10, 3: -2.00, 9: -3.0}
    assert nd.drift(ref, {7: -0.12, 3: -1.95, 9: -9.0}) == pytest.approx(0.05)  # the 3rd is ignored
    assert nd.drift(ref, {3: -0.5, 7: -0.6}) == pytest.approx(1.5)  # top-2 swapped: still measured
    assert nd.drift(ref, {7: -0.10}) == pytest.approx(0.0)  # ref's 2nd below the other's cut: skipped
    assert nd.drift(ref, {3: -0.1, 9: -0.2}) == math.inf  # ref's top-1 gone from the other's top-k
    assert math.isnan(nd.drift({}, {7: -0.1}))


def test_mann_whitney_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(5)
    for shift in (0.0, 0.3):
        x = [rng.random() + shift for _ in range(25)]
        y = [rng.random() for _ in range(40)] + [0.5] * 6  # ties
        want = stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True).pvalue
        assert nd.mann_whitney_greater(x, y) == pytest.approx(want, rel=1e-9)
    assert nd.mann_whitney_greater([], [1.0]) == 1.0
    assert nd.mann_whitney_greater([1.0, 1.0], [1.0]) == 1.0  # all tied
    assert nd.mann_whitney_greater([math.inf] * 5, [0.1, 0.2, 0.3, 0.4, 0.5]) < 0.01


def test_a_requests_floor_adds_its_two_noises():
    split = [{"key": "a", "drift": 1e-3}, {"key": "b", "drift": 0.0}]
    batch = [{"key": "b", "drift": 2e-3}, {"key": "a", "drift": 5e-4}]
    assert nd.request_floors(split, batch) == pytest.approx([1.5e-3, 2e-3])


def test_judge_flags_what_noise_cannot_reach():
    floor = [1e-3, 2e-3, 5e-3, 1e-3]
    ok = nd.judge([("a", 4e-3), ("b", 1.9e-2)], floor)
    assert ok["within_floor"] and ok["tau"] == 5e-3 and ok["flag_limit"] == pytest.approx(5e-3 * nd.FLAG_FACTOR)
    bad = nd.judge([("a", 4e-3), ("b", 0.3), ("c", math.inf)], floor)
    assert nd.FLAG_FACTOR * 5e-3 < 0.3
    assert not bad["within_floor"] and bad["flagged"] == ["b", "c"]
    assert not nd.judge([], floor)["within_floor"]  # nothing restored: nothing shown
    with pytest.raises(ValueError):
        nd.judge([("a", 1.0)], [math.nan])


# ----------------------------------------------------------------------------- CLI
def _cli(*args, timeout=120):
    return run_benchmark("benchmarks.noise_differential", list(args), timeout)


def test_help_explains_every_flag():
    needles = ("floor", "drift", "--disable-radix-cache", "sitecustomize", "results.json", "States", "--no-states")
    check_cli("benchmarks.noise_differential", needles, parser=nd.build_parser())


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--requests", "1"], "--requests"),
        (["--candidates", "fp16"], "--candidates"),
        (["--top-k", "1"], "--top-k"),
        (["--url", "int8=http://x", "--candidates", "fp32"], "--url"),
        (["--corrupt", "fp8"], "--corrupt"),
    ],
)
def test_bad_flags_are_refused_before_any_server(args, msg):
    r = _cli(*args)
    assert r.returncode == 2 and msg in r.stderr


# ----------------------------------------------------------------------------- state probes
def _state(seed: int, layers=2, heads=2, v=8, k=4, conv=(3, 12)):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "temporal": torch.randn(layers, heads, v, k, generator=g),
        "conv": [torch.randn(layers, *conv, generator=g)],
    }


def test_state_drift_is_relative_and_takes_the_worse_part():
    a = _state(0)
    assert sp.state_drift(a, a) == {"temporal": 0.0, "conv": 0.0, "drift": 0.0}
    neg = {"temporal": -a["temporal"], "conv": a["conv"]}
    d = sp.state_drift(neg, a)
    assert d["temporal"] == pytest.approx(2.0) and d["conv"] == 0.0 and d["drift"] == pytest.approx(2.0)
    scaled = {"temporal": a["temporal"], "conv": [c * 1.01 for c in a["conv"]]}
    assert sp.state_drift(scaled, a)["drift"] == pytest.approx(0.01, rel=1e-5)  # fp32 inputs
    with pytest.raises(ValueError):
        sp.state_drift(_state(1, heads=3), a)


def test_codec_loss_is_what_each_checkpoint_dtype_loses():
    a = _state(2)
    assert sp.codec_loss(a, "fp32") == 0.0
    int8, bf16 = sp.codec_loss(a, "int8"), sp.codec_loss(a, "bf16")
    # round to nearest: at most half a step of amax/127 per element, so well under 1/127 relative
    assert 0 < int8 < 1 / 127 and 0 < bf16 < 2**-8
    with pytest.raises(ValueError):
        sp.codec_loss(a, "fp8")


def test_restore_log_hands_out_each_file_once(tmp_path):
    log = sp.RestoreLog(str(tmp_path))
    assert log.new() == []
    (tmp_path / "restore-00001.pt").write_bytes(b"x")
    (tmp_path / "final-k3state-a.pt").write_bytes(b"x")
    assert [os.path.basename(f) for f in log.new()] == ["restore-00001.pt"]
    (tmp_path / "restore-00002.pt").write_bytes(b"x")
    assert [os.path.basename(f) for f in log.new()] == ["restore-00002.pt"]
    assert log.new() == []


def test_server_env_puts_the_hooks_first_and_an_empty_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "stale.pt").write_bytes(b"x")
    env = sp.server_env(str(tmp_path), "ref", {"X": "1"})
    assert env["X"] == "1" and env["PYTHONPATH"].split(os.pathsep) == [sp.FAULTS_DIR, "/somewhere"]
    assert env[sp.STATE_DIR_ENV] == str(tmp_path / "ref") and os.listdir(env[sp.STATE_DIR_ENV]) == []
    again = sp.server_env(str(tmp_path), "ref", env)  # the hooks once, not twice
    assert again["PYTHONPATH"].split(os.pathsep).count(sp.FAULTS_DIR) == 1


# ----------------------------------------------------------------------------- end to end
def test_a_corrupted_restore_is_flagged_and_exact_ones_are_not(server_factory, tmp_path):
    """fp32 checkpoints restore exactly: their drift stays within the noise of the cache-off servers.
    The corrupted server negates the first state it restores: that request is flagged, by its first
    token and by its state, and none of its other restores is; the run exits 0 only because the
    harness caught it (it exits 3 when a corruption goes unflagged)."""
    fp32 = server_factory("k3")
    out = tmp_path / "out"
    code = nd.main(
        [
            "--requests",
            "16",
            "--max-new-tokens",
            "4",
            "--seed",
            "1",
            "--candidates",
            "fp32",
            "--corrupt",
            "fp32",
            "--url",
            f"fp32={fp32.url}",
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
            "--quiet",
        ]
    )
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert (out / "noise_differential.png").stat().st_size > 10_000
    assert res["config"]["seed"] == 1 and res["config"]["servers"]["fp32"] == {"external": fp32.url}
    conds = res["conditions"]
    assert list(conds) == [nd.SPLIT, nd.BATCH, "fp32", "fp32_corrupt"]
    floor = res["floor"]
    assert floor["n"] == 16 and 0 < floor["tau"] < 1e-3  # fp32 on CPU: tiny, but measured
    split = {d["key"]: d["drift"] for d in conds[nd.SPLIT]["requests"]}
    batch = {d["key"]: d["drift"] for d in conds[nd.BATCH]["requests"]}
    assert floor["tau"] == max(split[k] + batch[k] for k in split)
    for name in ("fp32", "fp32_corrupt"):
        v = res["verdicts"][name]
        assert v["tau"] == floor["tau"] and v["restored_requests"] >= 5, v
        assert v["restored_requests"] == sum(d["restored"] for d in conds[name]["requests"])
    assert res["verdicts"]["fp32"]["within_floor"], res["verdicts"]["fp32"]
    assert conds["fp32"]["greedy"]["flips"] == 0
    bad = res["verdicts"]["fp32_corrupt"]
    assert not bad["within_floor"] and len(bad["flagged"]) >= 1
    worst = max(d["drift"] for d in conds["fp32_corrupt"]["requests"] if d["key"] in bad["flagged"])
    assert worst > 1000 * floor["tau"]
    # the fault really fired in that server, once
    logs = [p for p in (tmp_path / "logs").iterdir() if p.is_file() and "fp32_corrupt" in p.name]
    assert sum(p.read_text(errors="replace").count("[fault injection] negated") for p in logs) == 1

    # states: only servers started with the hooks are judged (the external fp32 one is not)
    states = res["states"]
    assert states["skipped"] is None and list(states["verdicts"]) == ["fp32_corrupt"]
    sv = states["verdicts"]["fp32_corrupt"]
    assert sv["restored_requests"] == bad["restored_requests"] and sv["hits_without_a_store_restore"] == 0
    first = next(d["key"] for d in conds["fp32_corrupt"]["requests"] if d["restored"])
    assert sv["flagged"] == [first]  # the first restore, the one negated, and no other
    rows = {r["key"]: r for r in sv["requests"]}
    assert rows[first]["temporal"] == pytest.approx(2.0, rel=1e-3)  # -T against T
    assert all(r["drift"] <= sv["flag_limit"] for k, r in rows.items() if k != first)
    assert 0 < sv["tau"] < 1e-4 and all(r["codec"] == 0.0 for r in rows.values())
    for r in rows.values():
        assert r["restores"] == 1 and r["cached_tokens"] > 0
        assert sv["tau"] >= r["split"] + r["batch"]  # the floor is the largest of its requests'
