"""The live A/B harness (``python -m benchmarks.live_ab``) end to end with the smallest sizes: two
real servers (k3 and upstream), all three workloads. Checks the output schema, that every derived
number (hit rate, prefill tokens, k3/upstream ratios) is computed from the measured ones, that
greedy outputs of the two caches are identical, and that k3 hits at least as much as upstream on
multi-turn chat. Plus fast checks of the pure helpers and of the CLI's clear errors."""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from server_utils import run_benchmark  # noqa: E402

from benchmarks import live_ab  # noqa: E402
from benchmarks.live.client import percentile  # noqa: E402

REAL_TRACE = live_ab.DEFAULT_TRACE
METRICS = {
    "requests": int,
    "errors": int,
    "prompt_tokens": int,
    "cached_tokens": int,
    "prefill_tokens": int,
    "hit_rate": float,
    "output_tokens": int,
    "duration_s": float,
    "output_tok_per_s": float,
    "ttft_p50_s": float,
    "ttft_p90_s": float,
}


def _k3_fp32_args() -> str:
    """fp32 checkpoints are the bit-exact oracle; pass the flag only where this tree has it."""
    import argparse

    from sglang_k3.integration import k3_args

    p = argparse.ArgumentParser()
    k3_args.add_k3_args(p)
    return "--k3-checkpoint-dtype fp32" if "--k3-checkpoint-dtype" in p._option_string_actions else ""


_run = functools.partial(run_benchmark, "benchmarks.live_ab")


# ----------------------------------------------------------------------------- fast checks
def test_help_documents_every_flag():
    r = _run(["--help"], 120)
    assert r.returncode == 0, r.stderr
    actions = [a for a in live_ab.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 25
    for a in actions:
        assert a.help and a.option_strings[0] in r.stdout, a.option_strings
    for flag in (
        "--model-path",
        "--extra-server-args",
        "--trace",
        "--trace-scale",
        "--trace-requests",
        "--mt-conversations",
        "--gsp-groups",
        "--out",
        "--workloads",
    ):
        assert flag in r.stdout


def test_bad_flags_and_missing_trace_are_clear(tmp_path):
    r = _run(["--workloads", "nope"], 120)
    assert r.returncode == 2 and "--workloads" in r.stderr
    r = _run(["--trace-scale", "3"], 120)
    assert r.returncode == 2 and "--trace-scale" in r.stderr
    for bad, needle in (
        (["--mt-branches", "0"], "--mt-branches"),
        (["--mt-branches", "2", "--mt-fork-at", "0"], "--mt-fork-at"),
        (["--mt-system-prompts", "0"], "--mt-system-prompts"),
    ):
        r = _run(bad, 120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
    missing = str(tmp_path / "no_such_trace.jsonl")
    r = _run(["--workloads", "trace", "--trace", missing, "--out", str(tmp_path)], 120)
    assert r.returncode == 2
    assert "SKIP trace workload" in r.stdout and missing in r.stdout
    assert not (tmp_path / "results.json").exists()


def test_ratios_and_comparison_helpers():
    recs = [
        {
            "workload": "w",
            "cache": "k3",
            "hit_rate": 0.5,
            "ttft_p50_s": 1.0,
            "ttft_p90_s": 2.0,
            "output_tok_per_s": 3.0,
            "prefill_tokens": 50,
        },
        {
            "workload": "w",
            "cache": "upstream",
            "hit_rate": 0.25,
            "ttft_p50_s": 2.0,
            "ttft_p90_s": 4.0,
            "output_tok_per_s": 1.5,
            "prefill_tokens": 0,
        },
    ]
    (q,) = live_ab.compute_ratios(recs)
    assert q == {
        "workload": "w",
        "hit_rate": 2.0,
        "ttft_p50_s": 0.5,
        "ttft_p90_s": 0.5,
        "output_tok_per_s": 2.0,
        "prefill_tokens": None,
    }
    g = live_ab.compare_outputs({"a": [1, 2, 3], "b": [4]}, {"a": [1, 9, 3], "b": [4], "c": [5]})
    assert g["compared"] == 2 and g["mismatches"] == 1 and g["missing"] == 1
    assert g["details"][0]["first_diff"] == 1
    assert percentile([3, 1, 2], 50) == 2 and math.isclose(percentile([0, 10], 90), 9.0)


@pytest.mark.skipif(not os.path.exists(REAL_TRACE), reason="Mooncake trace not shipped here")
def test_trace_slice_links_turns_and_scales():
    from benchmarks.live.workloads import build_trace_slice

    ts = build_trace_slice(REAL_TRACE, requests_n=6, window=1000, scale=32, max_output=16)
    assert len(ts) == 6 and any(p >= 0 for p in ts.parent)
    for i, p in enumerate(ts.parent):
        if p >= 0:  # a later turn holds its parent's prompt, then the parent's output, then new text
            lp, op = len(ts.prompts[p]), ts.out_len[p]
            assert ts.prompts[i][:lp] == ts.prompts[p]
            assert [ts.out_atom.get(s) for s in ts.prompts[i][lp : lp + op]] == [(p, j) for j in range(op)]
    assert all(1 <= m <= 16 for m in ts.max_new_tokens)


@pytest.mark.skipif(not os.path.exists(REAL_TRACE), reason="Mooncake trace not shipped here")
def test_trace_slice_under_a_context_keeps_only_conversations_that_fit():
    """Under --pressure the servers refuse a prompt near --max-total-tokens (an abort, whose
    output ids are no answer); the slice leaves out conversations with such a turn."""
    from benchmarks.live.workloads import build_trace_slice

    kw = dict(requests_n=32, window=3000, scale=32, max_output=16)
    full = build_trace_slice(REAL_TRACE, **kw)
    room = live_ab.PRESSURE_CONTEXT
    assert max(len(p) + m for p, m in zip(full.prompts, full.max_new_tokens)) > room  # the case exists
    fit = build_trace_slice(REAL_TRACE, max_context=room, **kw)
    assert len(fit) == 32 and fit.description["max_context"] == room
    assert max(len(p) + m for p, m in zip(fit.prompts, fit.max_new_tokens)) <= room


# ----------------------------------------------------------------------------- end to end
SMALL = [
    "--gsp-groups",
    "1",
    "--gsp-prompts-per-group",
    "2",
    "--gsp-system-len",
    "128",
    "--gsp-question-len",
    "16",
    "--gsp-output-len",
    "2",
    "--mt-conversations",
    "2",
    "--mt-turns",
    "3",
    "--mt-branches",  # each chat forks at its second turn: the second branch restores at the fork
    "2",
    "--mt-fork-at",
    "1",
    "--mt-system-len",
    "64",
    "--mt-first-len",
    "64",
    "--mt-user-len",
    "16",
    "--mt-reply-len",
    "2",
    "--trace-requests",
    "3",
    "--trace-scale",
    "64",
    "--trace-max-output",
    "2",
    "--quiet",
]


def test_live_ab_end_to_end(tmp_path):
    out = tmp_path / "out"
    args = [
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        "--caches",
        "k3,upstream,off",
        "--time-cache",
        "--warm-pass",  # each server answers gsp and multiturn once with other prompts first: not in the records
        *SMALL,
    ]
    k3_args = _k3_fp32_args()
    if k3_args:
        args += ["--k3-server-args", k3_args]
    r = _run(args, 600)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    res = json.loads((out / "results.json").read_text())
    assert (out / "live_ab.png").stat().st_size > 1000
    assert res["schema"] == live_ab.SCHEMA
    assert res["settings"]["warm_pass"] is True
    for key in ("command", "runtime_s", "machine", "git", "settings", "records", "ratios", "greedy", "skipped"):
        assert key in res
    for c in ("k3", "upstream"):  # the two servers differ only in the cache backend (+ the k3 oracle flag)
        sa = res["settings"]["server_args"][c]
        assert sa[sa.index("--radix-cache-backend") + 1] == c
    workloads = ["gsp", "multiturn", "trace"] if os.path.exists(REAL_TRACE) else ["gsp", "multiturn"]
    by = {(x["workload"], x["cache"]): x for x in res["records"]}
    assert set(by) == {(w, c) for w in workloads for c in ("k3", "upstream", "off")}
    assert "--disable-radix-cache" in res["settings"]["server_args"]["off"]
    expected_requests = {"gsp": 2, "multiturn": 2 * (3 + 2), "trace": 3}  # 2 chats: 3 turns, then 2 more
    for (w, c), rec in by.items():
        for k, t in METRICS.items():
            assert isinstance(rec[k], t), (w, c, k, rec[k])
        assert rec["requests"] == expected_requests[w] and rec["errors"] == 0
        assert rec["prefill_tokens"] == rec["prompt_tokens"] - rec["cached_tokens"]
        assert math.isclose(rec["hit_rate"], rec["cached_tokens"] / rec["prompt_tokens"])
        assert math.isclose(rec["output_tok_per_s"], rec["output_tokens"] / rec["duration_s"])
        assert 0 < rec["ttft_p50_s"] <= rec["ttft_p90_s"]
        assert rec["output_tokens"] > 0
        # the cache timer ran inside each server: every workload took scheduling steps and cache calls
        t = rec["cache_time"]
        assert t["steps"] > 0 and t["cache_calls"] > 0 and t["cache_cpu_ms_per_step"] > 0, (w, c, t)
        assert t["cache_cpu_s"] * 1e3 >= sum(t["top_methods_cpu_ms"].values()) * 0.999
        # each request is kept on its own, and the cell's sums are theirs
        per = rec["per_request"]
        assert len(per) == rec["requests"] and len({p["key"] for p in per}) == len(per)
        assert sum(p["cached_tokens"] for p in per) == rec["cached_tokens"]
        assert sum(p["prompt_tokens"] for p in per) == rec["prompt_tokens"]
        assert max(p["ttft_s"] for p in per) >= rec["ttft_p90_s"] >= min(p["ttft_s"] for p in per) > 0
    for w in workloads:  # the k3 server's page counters are read after each workload
        assert {"kv_page_copies", "unkeyed_state_skips"} <= set(res["k3_cache_after_each_workload"][w])
    # ratios are k3 / upstream of the measured numbers
    assert {q["workload"] for q in res["ratios"]} == set(workloads)
    for q in res["ratios"]:
        k, u = by[(q["workload"], "k3")], by[(q["workload"], "upstream")]
        for m in live_ab.RATIO_METRICS:
            if u[m]:
                assert math.isclose(q[m], k[m] / u[m]), (q["workload"], m)
            else:
                assert q[m] is None
        # the cache-off server computes every prompt token; both caches are set against it
        o = by[(q["workload"], "off")]
        assert o["cached_tokens"] == 0 and o["prefill_tokens"] == o["prompt_tokens"]
        for c, r in (("k3", k), ("upstream", u)):
            want = r["prefill_tokens"] / o["prefill_tokens"]
            assert math.isclose(q["against_off"][c]["prefill_tokens"], want), (q["workload"], c)
    # the oracle: same greedy tokens with either cache, and as the cache-off server's
    for w in workloads[1:]:
        g = res["greedy"][w]
        assert g["compared"] == expected_requests[w] and g["mismatches"] == 0 and g["missing"] == 0, g
        for c in ("k3", "upstream"):
            x = g["against_off"][c]
            assert x["compared"] == expected_requests[w] and x["mismatches"] == 0 and x["missing"] == 0, (w, c, x)
    # turns extend the previous turn, so the multi-turn workload must hit; k3 at least as much as upstream
    assert by[("multiturn", "k3")]["hit_rate"] > 0
    assert by[("multiturn", "k3")]["hit_rate"] >= by[("multiturn", "upstream")]["hit_rate"]


def test_pressure_mode_sizes_and_output_folder():
    a = live_ab.parse_args(["--pressure"])
    assert a.out == live_ab.PRESSURE_OUT
    for name, value in live_ab.PRESSURE_SIZES.items():
        assert getattr(a, name) == value
    b = live_ab.parse_args(["--pressure", "--mt-conversations", "5", "--out", "x"])
    assert b.mt_conversations == 5 and b.out == "x"  # explicit sizes win
    assert live_ab.parse_args([]).out == live_ab.DEFAULT_OUT
    sa = live_ab.server_args(a, "upstream")
    assert " ".join(sa).count("--max-total-tokens 1536") == 1 and "--enable-metrics" in sa


def test_pressure_end_to_end(tmp_path):
    """Both servers under the same small budget; upstream's --enable-unified-memory is tried and
    its refusal recorded; the JSON has each server's command, the running-request peaks and k3's
    memory split."""
    out = tmp_path / "out"
    args = ["--pressure", "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet"]
    args += ["--workloads", "multiturn", "--mt-conversations", "3", "--mt-turns", "2"]
    args += ["--k3-server-args", "--k3-checkpoint-dtype fp32"]  # the bit-exact oracle
    r = _run(args, 900)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    res = json.loads((out / "results.json").read_text())
    p = res["pressure"]
    assert p["budget_flags"] == live_ab.PRESSURE_BUDGET and p["budget_bytes"] > 0
    uu = p["upstream_unified_memory"]
    assert "--enable-unified-memory" in uu["command"]
    if not uu["started"]:  # on a CPU SGLang refuses it: the page-major KV layout it turns on has no
        # CPU attention backend, and the unified pool path rejects out-of-tree platforms
        assert any(w in ln for ln in uu["error"] for w in ("page-major", "Out-of-tree", "unified")), uu
    for c in ("k3", "upstream"):
        assert "--max-total-tokens 1536" in res["server_commands"][c]
    for rec in res["records"]:
        assert rec["running_peak"] is not None and 1 <= rec["running_peak"] <= 4
    split = res["k3_cache_after_each_workload"]["multiturn"]
    assert split["memory_budget_bytes"] == p["budget_bytes"]
    assert split["memory_kv_bytes"] + split["memory_checkpoint_bytes"] > 0
    assert res["greedy"]["multiturn"]["mismatches"] == 0


def test_the_native_gsp_driver_shares_each_groups_system_prompt(server_factory):
    """``--gsp-driver native`` (what the GPU runs, where SGLang's bench_serving cannot import):
    every request of a group carries the group's system prompt, so with one request at a time each
    group's later requests restore it, and the greedy tokens equal a cache-off server's (fp32
    checkpoints). Two groups of three, sent in a seeded shuffle."""
    from benchmarks.live import workloads as wl
    from sglang_k3.model.tiny_build import default_model_path

    k3, plain = server_factory("k3"), server_factory("nocache")
    vocab = wl.vocabulary(default_model_path())
    sizes = dict(groups=2, prompts_per_group=3, system_len=256, question_len=16, output_len=4, concurrency=1)
    k3.flush_cache()
    got, outs = wl.run_gsp_native(k3.url, "k3", vocab, seed=5, verbose=False, **sizes)
    ref, ref_outs = wl.run_gsp_native(plain.url, "nocache", vocab, seed=5, verbose=False, **sizes)
    assert got["requests"] == 6 and got["errors"] == 0 and got["prompt_tokens"] == 6 * (256 + 16)
    assert ref["cached_tokens"] == 0
    assert got["cached_tokens"] >= 4 * 192  # each group's later two restore most of its system prompt
    assert sorted(outs) == sorted(f"gsp/{g}/{q}" for g in range(2) for q in range(3))
    assert outs == ref_outs
