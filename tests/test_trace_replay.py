"""The trace replay CLI (``python -m benchmarks.trace_replay``): output schema, the orderings any
correct replay must show (oracle >= every policy, fa-budget >= k3 on one tier), and clear errors
for bad input. Runs on a synthetic multi-turn trace and, when present, on the first 3000 lines of
the shipped Mooncake trace (the first 300 lines cover ~90 s of the trace, before any second turn
arrives: every hybrid policy then hits only the shared system prompt and k3 == upstream exactly,
which tests nothing; 3000 lines take ~10 s)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_TRACE = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "mooncake_conversation_trace.jsonl"))
ALL = ["k3", "k3-fixed", "upstream", "upstream-int8", "vllm-align", "marconi", "oracle", "fa-budget"]
FIELDS = {
    "policy": str,
    "budget_gib": (int, float),
    "hit_rate": float,
    "oracle_fraction": float,
    "fa_budget_fraction": float,
    "prefill_tokens": int,
    "ttft_p50_s": float,
    "ttft_p90_s": float,
    "checkpoint_bytes": (int, float),
}


def synthetic_trace(path, seed=0):
    """Multi-turn conversations that share a system block, plus documents that several requests
    fork from: turn k+1 repeats turn k's full blocks, then new ids (Mooncake's shape)."""
    rnd = random.Random(seed)
    nxt = [1]

    def new_ids(n):
        out = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    rows = []
    for c in range(10):
        L, O, ids, t = 512 + rnd.randint(1500, 4000), rnd.randint(50, 400), None, c * 3000
        ids = [0] + new_ids(-(-L // 512) - 1)
        for _ in range(5):
            rows.append(dict(timestamp=t, input_length=L, output_length=O, hash_ids=ids))
            keep = ids[: L // 512]
            L = L + O + rnd.randint(100, 1500)
            O = rnd.randint(50, 400)
            ids = keep + new_ids(-(-L // 512) - len(keep))
            t += rnd.randint(20_000, 60_000)
    for d in range(3):
        doc = [0] + new_ids(5)
        for q in range(4):
            L = 6 * 512 + rnd.randint(200, 2000)
            rows.append(
                dict(
                    timestamp=d * 7000 + q * 9000 + 500,
                    input_length=L,
                    output_length=rnd.randint(20, 200),
                    hash_ids=doc + new_ids(-(-L // 512) - 6),
                )
            )
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return len(rows)


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_replay", "--no-progress", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_schema(records, policies, budgets):
    assert [(r["policy"], r["budget_gib"]) for r in records] == [(p, b) for p in policies for b in budgets]
    for r in records:
        for k, t in FIELDS.items():
            assert isinstance(r[k], t), (k, r[k])
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["hit_tokens"] >= 0
        assert 0 <= r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert r["checkpoint_bytes"] >= 0
    by = {(r["policy"], r["budget_gib"]): r for r in records}
    for b in budgets:
        oracle, fa = by[("oracle", b)], by[("fa-budget", b)]
        assert oracle["oracle_fraction"] == pytest.approx(1.0) and fa["fa_budget_fraction"] == pytest.approx(1.0)
        for p in policies:
            r = by[(p, b)]
            assert r["hit_rate"] <= oracle["hit_rate"] + 1e-12, (p, b)
            assert r["oracle_fraction"] == pytest.approx(r["hit_rate"] / oracle["hit_rate"])
        for p in ("oracle", "fa-budget"):
            assert by[(p, b)]["checkpoint_bytes"] == 0
    return by


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    trace = d / "trace.jsonl"
    n = synthetic_trace(trace)
    out = d / "out"
    res = run_cli(
        "--trace",
        str(trace),
        "--policies",
        ",".join(ALL),
        "--budgets-gib",
        "0.25,2",
        "--model-config",
        "kimi-linear-48b",
        "--checkpoint-dtype",
        "int8",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return n, out, json.loads((out / "results.json").read_text())


def test_synthetic_schema_and_orderings(synthetic_run):
    n, out, records = synthetic_run
    by = check_schema(records, ALL, [0.25, 2])
    assert all(r["requests"] == n for r in records)
    assert (out / "hit_rate.png").stat().st_size > 1000
    for b in (0.25, 2):
        assert by[("fa-budget", b)]["hit_rate"] >= by[("k3", b)]["hit_rate"], b  # one tier: KV-only is the ceiling
    # the workload has reuse, the oracle sees it, and a large budget keeps most of it for k3
    assert by[("oracle", 2)]["hit_rate"] > 0.5
    assert by[("k3", 2)]["oracle_fraction"] > 0.8
    assert by[("k3", 0.25)]["hit_rate"] <= by[("k3", 2)]["hit_rate"]
    assert by[("upstream", 2)]["checkpoint_bytes"] > 0 and by[("k3", 2)]["checkpoint_bytes"] > 0


def test_subset_of_policies_still_reports_fractions(tmp_path):
    trace = tmp_path / "t.jsonl"
    synthetic_trace(trace, seed=1)
    res = run_cli(
        "--trace",
        str(trace),
        "--policies",
        "k3",
        "--budgets-gib",
        "1",
        "--out",
        str(tmp_path / "o"),
        "--model-config",
        "tiny",
        "--checkpoint-dtype",
        "bf16",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "o" / "results.json").read_text())
    assert rec["policy"] == "k3" and rec["budget_gib"] == 1 and 0 < rec["oracle_fraction"] <= 1
    assert rec["fa_budget_fraction"] > 0 and rec["state_dtype"] == "bf16" and rec["model_config"] == "tiny"


def test_lower_tiers_bring_back_what_the_device_evicted(tmp_path):
    """k3 with a host tier and an L3 tier below a device budget too small for the synthetic trace:
    the tiers serve hits the device alone cannot, the host before L3, and the records say so;
    other policies are not given tiers."""
    trace = tmp_path / "t.jsonl"
    synthetic_trace(trace, seed=3)
    runs = {}
    for label, extra in (("device", []), ("host", ["--host-budget-gib", "2"]), ("l3", ["--l3-budget-gib", "4"])):
        out = tmp_path / label
        res = run_cli(
            "--trace", str(trace), "--policies", "k3,upstream", "--budgets-gib", "0.25", "--out", str(out), *extra
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs[label] = {r["policy"]: r for r in json.loads((out / "results.json").read_text())}
    dev, host, l3 = (runs[k]["k3"] for k in ("device", "host", "l3"))
    assert "tiers" not in dev and dev["host_budget_gib"] == 0
    assert host["hit_rate"] > dev["hit_rate"] and l3["hit_rate"] > dev["hit_rate"]
    assert host["tiers"]["hits"]["host"] > 0 and "l3" not in host["tiers"]["hits"]
    assert l3["tiers"]["hits"]["l3"] > 0 and l3["l3_budget_gib"] == 4
    t = host["tiers"]  # what the host tier held at the end: whole checkpoints, within its budget
    assert 0 < t["tier_host_state_bytes"] < t["tier_host_bytes"] <= t["tier_host_budget_bytes"] == 2 << 30
    assert t["tier_host_state_bytes"] % host["state_bytes_per_checkpoint"] == 0
    assert host["oracle_fraction"] <= 1 and l3["oracle_fraction"] <= 1
    # upstream has no tier here: the same number with and without the flags, and labelled so
    assert runs["host"]["upstream"]["hit_rate"] == runs["device"]["upstream"]["hit_rate"]
    assert runs["host"]["upstream"]["host_budget_gib"] == 0


@pytest.mark.skipif(not os.path.exists(REAL_TRACE), reason="shipped Mooncake trace not present")
def test_real_trace_slice(tmp_path):
    trace = tmp_path / "slice.jsonl"
    with open(REAL_TRACE) as f, open(trace, "w") as g:
        for _, line in zip(range(3000), f):
            g.write(line)
    budgets = [4, 40]
    # every policy at two budgets: 97-101 s on this project's 2-core machine, so the default 120 s
    # would fail a loaded CI runner; the timeout is there to catch a hang, not to time the replay
    res = run_cli(
        "--trace",
        str(trace),
        "--policies",
        ",".join(ALL),
        "--budgets-gib",
        "4,40",
        "--out",
        str(tmp_path / "o"),
        timeout=480,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = json.loads((tmp_path / "o" / "results.json").read_text())
    by = check_schema(records, ALL, budgets)
    for b in budgets:
        k3, up = by[("k3", b)]["hit_rate"], by[("upstream", b)]["hit_rate"]
        print(
            f"real slice, {b} GiB: k3 {k3:.4f} upstream {up:.4f} fa-budget {by[('fa-budget', b)]['hit_rate']:.4f} "
            f"oracle {by[('oracle', b)]['hit_rate']:.4f}"
        )
        assert by[("fa-budget", b)]["hit_rate"] >= k3
        assert all(by[(p, b)]["hit_rate"] <= by[("oracle", b)]["hit_rate"] for p in ALL)
    # k3 as shipped (unified memory, int8, one state per turn): measured 0.173 vs upstream's 0.093
    # and k3-fixed's 0.060 at 40 GiB, where one budget lets checkpoints take what a fixed pool
    # cannot; at 4 GiB it is below upstream (0.036 vs 0.040: checkpoints displace KV when bytes are
    # tight; see docs/results.md).
    assert by[("k3", 40)]["hit_rate"] >= 1.4 * by[("upstream", 40)]["hit_rate"]
    assert by[("k3", 40)]["hit_rate"] >= 2 * by[("k3-fixed", 40)]["hit_rate"]


def test_help_explains_the_contract():
    res = run_cli("--help")
    assert res.returncode == 0
    for flag in (
        "--trace",
        "--policies",
        "--budgets-gib",
        "--model-config",
        "--checkpoint-dtype",
        "--out",
        "kimi-linear-48b",
        "fa-budget",
        "results.json",
    ):
        assert flag in res.stdout, flag


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--trace", "/nonexistent/trace.jsonl"], "trace file not found"),
        (["--policies", "k3,lru-magic"], "unknown policy 'lru-magic'"),
        (["--budgets-gib", "10,abc"], "--budgets-gib"),
        (["--budgets-gib", "-5"], "positive"),
        (["--model-config", "gpt"], "invalid choice"),
        (["--checkpoint-dtype", "int4"], "invalid choice"),
        (["--host-budget-gib", "-1"], "--host-budget-gib must be"),
        (["--l3-gbps", "0"], "must be > 0"),
    ],
)
def test_bad_arguments(args, needle, tmp_path):
    res = run_cli(*args, "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "line3, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "needs ceil(600/512) = 2"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 5, "hash_ids": []}', "input_length"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_its_number(line3, needle, tmp_path):
    good = json.dumps(dict(timestamp=0, input_length=700, output_length=10, hash_ids=[0, 1]))
    trace = tmp_path / "bad.jsonl"
    trace.write_text(f"{good}\n{good}\n{line3}\n{good}\n")
    res = run_cli("--trace", str(trace), "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    assert f"{trace}:3:" in res.stderr and needle in res.stderr, res.stderr


def test_empty_trace(tmp_path):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    res = run_cli("--trace", str(trace), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "no requests" in res.stderr
