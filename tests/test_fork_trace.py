"""The fork-heavy trace generator (``python -m benchmarks.fork_trace``): Mooncake format, determinism,
and that the sharing it designs (forks inside earlier prompts, exact regenerates, turns, fork
siblings) is what ``benchmarks/trace/mooncake.py`` actually converts it to; the oracle replay of it
hits far more than a trace without sharing. Small traces, no servers (a few seconds)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import fork_trace, trace_replay
from benchmarks.trace import load_trace, to_symbolic
from benchmarks.trace.mooncake import TraceRequest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 400
BASE = ["--requests", str(N), "--seed", "7"]


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A generated trace, written with the CLI's own serialisation, and its conversion."""
    path = tmp_path_factory.mktemp("fork") / "t.jsonl"
    g = fork_trace.generate(fork_trace.parse_args(["--out", str(path), *BASE]))
    path.write_text(g.dumps())
    reqs = load_trace(str(path))
    return path, g, reqs, to_symbolic(reqs)


def test_cli_writes_mooncake_jsonl_and_summary(tmp_path, capsys):
    out = tmp_path / "sub" / "t.jsonl"
    assert fork_trace.main(["--out", str(out), *BASE, "--length-scale", "0.5"]) == 0
    cap = capsys.readouterr()
    assert "fork_trace:" in cap.err and f"{N}/{N} requests" in cap.err
    for needle in ("requests", "prompt tokens", "agent", "edit", "tot", "fork", "shared prefix", "turn links"):
        assert needle in cap.out, needle
    assert f"{N}/{N} parent links as designed" in cap.out, cap.out
    lines = out.read_text().splitlines()
    assert len(lines) == N == len(load_trace(str(out)))
    prev = 0
    for line in lines:
        obj = json.loads(line)
        assert list(obj) == ["timestamp", "input_length", "output_length", "hash_ids"]
        assert isinstance(obj["timestamp"], int) and obj["timestamp"] >= prev
        prev = obj["timestamp"]
        L = obj["input_length"]
        assert 1024 <= L <= 65536
        assert len(obj["hash_ids"]) == math.ceil(L / 512)
        assert obj["output_length"] == 0 or 100 <= obj["output_length"] <= 800
    # hash ids are numbered in order of first appearance, as in the Mooncake trace
    seen = -1
    for line in lines:
        for h in json.loads(line)["hash_ids"]:
            assert h <= seen + 1
            seen = max(seen, h)


def test_deterministic_bytes(tmp_path, capsys):
    a, b, c = (tmp_path / f"{x}.jsonl" for x in "abc")
    for p, seed in ((a, "3"), (b, "3"), (c, "4")):
        assert fork_trace.main(["--out", str(p), "--requests", "300", "--seed", seed, "--no-stats"]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_turn_links_are_the_designed_ones(small):
    _, g, reqs, st = small
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    assert list(st.parent) == g.parent  # every link mooncake.py makes is the intended one, and only those
    linked = [i for i, p in enumerate(st.parent) if p >= 0]
    assert len(linked) > N // 3
    for i in linked:
        p = st.parent[i]
        carried = (st.input_len[p] + st.output_len[p]) // st.unit
        # a turn sees its parent's prompt and output, then its own tokens
        assert st.prompt(i)[:carried] == st.full(p)[:carried], i
        assert st.input_len[i] >= st.input_len[p] + st.output_len[p]
    fams = {g.family[i] for i in linked}
    assert fams == {"agent", "edit", "tot", "fork"}


def test_regenerates_are_exact(small):
    _, g, reqs, st = small
    regens = [i for i, k in enumerate(g.kind) if k == "regen"]
    assert len(regens) >= 3
    for i in regens:
        q = g.origin[i]
        assert q < i and reqs[i].hash_ids == reqs[q].hash_ids and st.prompt(i) == st.prompt(q)
        assert st.parent[i] == -1


def test_edits_fork_inside_earlier_prompts(small):
    _, g, reqs, st = small
    edits = [i for i, k in enumerate(g.kind) if k == "edit"]
    assert len(edits) >= 5
    u = st.unit
    for i in edits:
        q, k = g.origin[i], g.kept[i]
        hq, hi = reqs[q].hash_ids, reqs[i].hash_ids
        assert q < i and 1 <= k < reqs[q].input_length // 512  # strictly inside q's full blocks
        assert hi[:k] == hq[:k] and hi[k] != hq[k] and k < len(hi)
        n = lcp(st.prompt(i), st.prompt(q))
        # the shared prefix covers the kept blocks and is a strict prefix of both prompts
        assert k * 512 // u <= n < min(len(st.prompt(q)), len(st.prompt(i)))
    # symbol level, whatever the labels: many pairs share a long proper prefix of both prompts
    prompts = [st.prompt(i) for i in range(len(st))]
    forks = 0
    for j in range(len(prompts)):
        for i in range(max(0, j - 40), j):
            n = lcp(prompts[i], prompts[j])
            if 16 <= n < min(len(prompts[i]), len(prompts[j])) - 1:
                forks += 1
    assert forks > N


def test_fork_and_tot_siblings_branch_at_the_shared_point(small):
    _, g, reqs, st = small
    u = st.unit
    kids: dict = {}
    for i, k in enumerate(g.kind):
        if k in ("branch", "join"):
            kids.setdefault(g.origin[i], []).append(i)
    commits = [p for p in kids if g.kind[p] == "commit"]
    roots = [p for p in kids if g.family[p] == "tot" and g.kind[p] != "commit"]
    assert commits and roots
    for p, ch in kids.items():
        point = (st.input_len[p] + st.output_len[p]) // u  # prompt (+ output) of the node
        sibs = [i for i in ch if g.kind[i] == "branch"]
        assert sibs and all(st.parent[i] == p for i in ch)
        assert len({reqs[i].timestamp for i in sibs}) == 1  # siblings arrive together
        for a, b in zip(sibs, sibs[1:]):
            assert lcp(st.prompt(a), st.prompt(b)) == point  # same prefix, diverge at the fork point
        for i in ch:
            assert reqs[i].timestamp > reqs[p].timestamp
    fork_sizes = [len([i for i in kids[p] if g.kind[i] == "branch"]) for p in commits if g.family[p] == "fork"]
    assert max(fork_sizes) == 4  # --fork-n


def test_agents_share_long_prefixes(small):
    _, g, _, st = small
    firsts = [i for i, (f, k) in enumerate(zip(g.family, g.kind)) if f == "agent" and k == "first"]
    assert len(firsts) >= 5
    best = [max(lcp(st.prompt(i), st.prompt(j)) for j in firsts if j != i) for i in firsts]
    assert sum(1 for b in best if b * st.unit >= 4096) >= len(firsts) // 2


def test_shares_follow_the_flags(tmp_path):
    a = fork_trace.parse_args(["--out", str(tmp_path / "x"), "--requests", "600"])
    g = fork_trace.generate(a)
    for f, share in (("agent", 0.3), ("edit", 0.3), ("tot", 0.2), ("fork", 0.2)):
        assert abs(g.family.count(f) / len(g) - share) < 0.03, f
    only = fork_trace.parse_args(
        ["--out", str(tmp_path / "y"), "--requests", "200", "--share-agent", "0", "--share-edit", "0"]
        + ["--share-tot", "0", "--share-fork", "1"]
    )
    g = fork_trace.generate(only)
    assert set(g.family) == {"fork"} and len(g) == 200


def test_oracle_replay_hits_far_above_a_trace_without_sharing(tmp_path, capsys):
    # no agent prefixes: the reuse must come from turns, regenerates, edits and forks
    path = tmp_path / "t.jsonl"
    g = fork_trace.generate(
        fork_trace.parse_args(["--out", str(path), "--requests", "300", "--seed", "5", "--share-agent", "0"])
    )
    path.write_text(g.dumps())
    stats = fork_trace.prefix_stats(g)
    # the same requests, every one fresh (single-turn, nothing shared)
    lone = tmp_path / "lone.jsonl"
    nxt = 0
    with open(lone, "w") as f:
        for r in g.rows:
            n = len(r["hash_ids"])
            f.write(json.dumps({**r, "hash_ids": list(range(nxt, nxt + n))}) + "\n")
            nxt += n
    hits = {}
    for name, p in (("fork", path), ("lone", lone)):
        out = tmp_path / f"o_{name}"
        args = ["--trace", str(p), "--policies", "oracle", "--budgets-gib", "40", "--out", str(out)]
        assert trace_replay.main([*args, "--jobs", "1", "--no-progress", "--limit", "300"]) == 0
        (rec,) = json.loads((out / "results.json").read_text())
        hits[name] = rec["hit_rate"]
    print(hits, stats["shared_prefix_fraction"])
    assert hits["lone"] < 0.01
    assert hits["fork"] > 0.5
    # the replayed oracle finds (almost) all the sharing the generator measured
    assert hits["fork"] == pytest.approx(stats["shared_prefix_fraction"], abs=0.05)


def test_length_scale_and_caps(tmp_path):
    a = fork_trace.parse_args(["--out", str(tmp_path / "x"), "--requests", "200", "--length-scale", "0.25"])
    assert a.agent_prefix_max == 8192 and a.tot_root_min == 1024 and a.chat_msg_min == 8
    g = fork_trace.generate(a)
    big = fork_trace.generate(fork_trace.parse_args(["--out", str(tmp_path / "y"), "--requests", "200"]))
    mean = lambda t: sum(r["input_length"] for r in t.rows) / len(t)
    assert mean(g) < 0.6 * mean(big)
    capped = fork_trace.generate(
        fork_trace.parse_args(["--out", str(tmp_path / "z"), "--requests", "300", "--max-prompt", "34000"])
    )
    assert max(r["input_length"] for r in capped.rows) <= 34000


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--share-agent", "-0.5"], "--share-agent must be a finite number >= 0"),
        (["--share-agent", "0", "--share-edit", "0", "--share-tot", "0", "--share-fork", "0"], "all 0"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--rate", "nan"], "--rate"),
        (["--regen-prob", "0.7", "--edit-prob", "0.5"], "--regen-prob + --edit-prob must be <= 1"),
        (["--fork-join-prob", "1.5"], "--fork-join-prob must be in [0, 1]"),
        (["--output-min", "900"], "--output-max (800) must be >= --output-min (900)"),
        (["--fork-n", "1"], "--fork-n must be >= 2"),
        (["--tot-depth", "0"], "--tot-depth must be >= 1"),
        (["--max-prompt", "8000"], "--max-prompt (8000) must be >="),
        (["--requests", "ten"], "invalid int value"),
    ],
)
def test_bad_flags_exit_2(args, needle, tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit) as e:
        fork_trace.main(["--out", str(out), *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_module_entry_point_help_and_errors(tmp_path):
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "benchmarks.fork_trace", *a], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    res = run("--help")
    assert res.returncode == 0
    flags = [s for s in res.stdout.split() if s.startswith("--")]
    assert len(set(flags)) > 40 and "--share-fork" in flags and "--seed" in flags
    assert res.stdout.count("(default:") >= 40
    res = run("--requests", "0", "--out", str(tmp_path / "t.jsonl"))
    assert res.returncode == 2 and "--requests must be >= 1" in res.stderr
    res = run("--requests", "5")
    assert res.returncode == 2 and "--out" in res.stderr


def test_trace_request_type_roundtrip(small):
    # the generator's rows are exactly what load_trace parses (no extra fields, same values)
    _, g, reqs, _ = small
    assert [
        TraceRequest(i + 1, float(r["timestamp"]), r["input_length"], r["output_length"], tuple(r["hash_ids"]))
        for i, r in enumerate(g.rows)
    ] == reqs
