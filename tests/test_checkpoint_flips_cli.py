"""``python -m benchmarks.checkpoint_flips``: its pure pieces on constructed data (margins, buckets,
first divergence, aggregation, the seeded workload), its command line, and one small end-to-end run
against two of the session's servers (cache-off reference, k3 with int8 checkpoints) started by
conftest's ``server_factory``: no extra servers."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from server_utils import check_cli, run_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import checkpoint_flips as cf  # noqa: E402

EDGES = list(cf.DEFAULT_EDGES)


def _entry(lps_ids):
    """One position of SGLang's ``output_top_logprobs``: ``[[logprob, token_id, text], ...]``."""
    return [[lp, tid, None] for lp, tid in lps_ids]


def _rec(tokens, margins, logprobs=None):
    return {
        "output_ids": list(tokens),
        "margins": list(margins),
        "logprobs": list(logprobs if logprobs is not None else [-1.0] * len(tokens)),
        "top2_ids": [[t, t + 1] for t in tokens],
        "cached_tokens": 0,
        "k3_restore_len": None,
        "prompt_tokens": 10,
    }


# ----------------------------------------------------------------------------- pure functions
def test_buckets_are_half_open_and_labelled():
    assert cf.bucket_labels(EDGES) == ["<1e-4", "1e-4..1e-3", "1e-3..1e-2", "1e-2..1e-1", ">=1e-1"]
    assert cf.bucket_index(0.0, EDGES) == 0
    assert cf.bucket_index(0.99e-4, EDGES) == 0
    assert cf.bucket_index(1e-4, EDGES) == 1  # [lo, hi)
    assert cf.bucket_index(5e-3, EDGES) == 2
    assert cf.bucket_index(0.1, EDGES) == 4
    assert cf.bucket_index(math.inf, EDGES) == 4
    assert cf.parse_edges("1e-4,1e-3") == [1e-4, 1e-3]
    for bad in ("", "1e-3,1e-4", "0,1", "1e-3,1e-3"):
        with pytest.raises(ValueError):
            cf.parse_edges(bad)


def test_top2_margin_from_sglang_entries():
    # the near-tie: -1.7785 vs -1.7786
    assert cf.top2_margin(_entry([(-1.7785, 65), (-1.7786, 66)])) == pytest.approx(1e-4)
    assert cf.bucket_index(cf.top2_margin(_entry([(-1.7785, 65), (-1.7786, 66)])), EDGES) in (0, 1)
    # order as returned does not matter; the margin is top-1 minus top-2
    assert cf.top2_margin(_entry([(-3.0, 1), (-0.5, 2)])) == pytest.approx(2.5)
    assert cf.top2_margin(_entry([(-0.1, 7)])) == math.inf


def test_first_divergence():
    a = [72, 101, 108, 108, 111]
    assert cf.first_divergence(a, list(a)) is None
    assert cf.first_divergence(a, [72, 101, 109, 108, 111]) == 2
    assert cf.first_divergence(a, [0] + a[1:]) == 0
    assert cf.first_divergence(a, a[:3]) == 3  # stopped early: diverges where it stops
    assert cf.first_divergence([], []) is None


def test_parse_response_reads_sglang_meta_info():
    out = {
        "output_ids": [65, 66],
        "meta_info": {
            "cached_tokens": 128,
            "prompt_tokens": 150,
            "k3_restore_len": [128],
            "output_token_logprobs": [[-0.2, 65, None], [-1.5, 66, None]],
            "output_top_logprobs": [_entry([(-0.2, 65), (-2.2, 70)]), _entry([(-1.5, 66), (-1.5005, 67)])],
        },
    }
    r = cf.parse_response(out)
    assert r["output_ids"] == [65, 66] and r["cached_tokens"] == 128 and r["k3_restore_len"] == 128
    assert r["logprobs"] == [-0.2, -1.5]
    assert r["margins"] == [pytest.approx(2.0), pytest.approx(5e-4)]
    assert r["top2_ids"] == [[65, 70], [66, 67]]


def test_compare_request_counts_positions_up_to_the_first_divergence():
    ref = _rec([5, 6, 7, 8], [0.5, 2e-3, 5e-5, 1.0], logprobs=[-0.1, -0.2, -0.3, -0.4])
    other = _rec([5, 6, 9, 8], [0.5, 2e-3, 5e-5, 1.0], logprobs=[-0.1003, -0.2, -0.9, -0.4])
    c = cf.compare_request(ref, other, EDGES)
    assert c["diverged_at"] == 2
    assert c["margin"] == 5e-5 and c["bucket"] == 0
    assert c["counted_buckets"] == [4, 2, 0]  # position 3 is after the divergence: not counted
    assert c["max_abs_logprob_diff"] == pytest.approx(3e-4)  # agreeing positions 0 and 1 only
    assert c["max_diff_at"]["position"] == 0 and c["max_diff_at"]["ref_margin"] == 0.5
    assert (c["ref_token"], c["other_token"], c["ref_top2_ids"]) == (7, 9, [7, 8])
    assert c["abs_margin_shifts"] == [0.0, 0.0]  # same top-2 ids and margins on the agreeing positions
    moved = _rec([5, 6, 7, 8], [0.4, 2.5e-3, 5e-5, 1.0])
    moved["top2_ids"][1] = [6, 99]  # other top-2 candidate at position 1: its gap is not comparable
    m = cf.compare_request(ref, moved, EDGES)
    assert m["diverged_at"] is None and m["abs_margin_shifts"] == [pytest.approx(0.1), 0.0, 0.0]
    same = cf.compare_request(ref, _rec([5, 6, 7, 8], [1, 1, 1, 1]), EDGES)
    assert same["diverged_at"] is None and same["bucket"] is None
    assert same["counted_buckets"] == [4, 2, 0, 4]


def test_aggregate_rates_per_bucket_and_unexposed_flips():
    ref = _rec([1, 2, 3], [5e-5, 0.5, 0.5])
    comps = []
    for key, other, exposed in (
        ("a", [9, 2, 3], True),  # flip at 0, margin bucket 0
        ("b", [1, 2, 3], True),  # agrees: 3 positions
        ("c", [1, 2, 9], True),  # flip at 2, bucket 4
        ("d", [9, 9, 9], False),
    ):  # not restored: counted apart
        c = cf.compare_request(ref, _rec(other, [1, 1, 1]), EDGES)
        c.update(key=key, kind="repeat", output_len=3, cached_tokens=64 if exposed else 0, exposed=exposed)
        comps.append(c)
    agg = cf.aggregate(comps, EDGES)
    assert agg["compared_requests"] == 4 and agg["exposed_requests"] == 3
    assert agg["flips"] == 2 and agg["flip_rate"] == pytest.approx(2 / 3)
    # gap shifts on agreeing positions: b -> 3 positions, c -> 2 (a diverged at once; d is unexposed)
    assert agg["margin_shift_positions"] == 5 and agg["abs_margin_shift_max"] == pytest.approx(1 - 5e-5)
    assert agg["abs_margin_shift_p50"] == pytest.approx(0.5)
    # positions: a -> [0]; b -> [0, 4, 4]; c -> [0, 4, 4]
    assert [b["positions"] for b in agg["buckets"]] == [3, 0, 0, 0, 4]
    assert [b["flips"] for b in agg["buckets"]] == [1, 0, 0, 0, 1]
    assert agg["buckets"][0]["rate"] == pytest.approx(1 / 3) and agg["buckets"][4]["rate"] == pytest.approx(1 / 4)
    assert agg["buckets"][1]["rate"] is None
    assert agg["positions_counted"] == 7 and agg["per_position_flip_rate"] == pytest.approx(2 / 7)
    assert agg["unexposed_requests"] == 1 and agg["unexposed_flips"] == 1
    assert {d["key"] for d in agg["flip_details"]} == {"a", "c", "d"}
    lo, hi = agg["flip_rate_ci95"]
    assert 0 < lo < 2 / 3 < hi < 1
    assert cf.wilson(0, 0) is None and cf.wilson(0, 10)[0] == 0.0


def test_workload_is_seeded_and_shares_prefixes():
    vocab = list(range(32, 127))
    w = cf.make_workload(7, 30, vocab)
    assert len(w) == 30 and len({it["key"] for it in w}) == 30
    assert [it["key"] for it in cf.make_workload(7, 30, vocab)] == [it["key"] for it in w]
    assert [it["key"] for it in cf.make_workload(8, 30, vocab)] != [it["key"] for it in w]
    # resolve every prompt with made-up replies, in workload order
    prompts, replies = {}, {}
    pos = {it["key"]: i for i, it in enumerate(w)}
    for it in w:
        prompts[it["key"]] = cf.resolve_prompt(it, prompts, replies)
        replies[it["key"]] = [40 + len(prompts[it["key"]]) % 50] * 4
    for it in w:
        p = prompts[it["key"]]
        assert all(t in vocab for t in p)
        group = [x for x in w if x["group"] == it["group"]]
        assert [pos[x["key"]] for x in group] == sorted(pos[x["key"]] for x in group)  # in order
        first = prompts[group[0]["key"]]
        if it["role"] == "again":
            assert p == first
        elif it["role"] == "branch":
            assert p[: len(it["base"])] == first[: len(it["base"])] and p != first
        elif it["role"] == "next":
            prev = it["base"][1]
            assert p == prompts[prev] + replies[prev] + it["user"]
    assert {it["kind"] for it in w} == set(cf.KINDS)


# ----------------------------------------------------------------------------- CLI
def _cli(*args, timeout=120):
    return run_benchmark("benchmarks.checkpoint_flips", list(args), timeout)


def test_help_explains_every_flag():
    assert len([a for a in cf.build_parser()._actions if a.option_strings]) >= 19
    needles = ("--k3-checkpoint-dtype", "--disable-radix-cache", "margin", "results.json")
    check_cli("benchmarks.checkpoint_flips", needles, parser=cf.build_parser())


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--requests", "1"], "--requests"),
        (["--dtypes", "fp16"], "--dtypes"),
        (["--bucket-edges", "1e-2,1e-3"], "--bucket-edges"),
        (["--system-len", "9"], "--system-len"),
        (["--k3-url", "x"], "--k3-url"),
    ],
)
def test_bad_flags_are_refused_before_any_server(args, msg):
    r = _cli(*args)
    assert r.returncode == 2 and msg in r.stderr


# ----------------------------------------------------------------------------- end to end
def test_small_run_against_session_servers(server_factory, tmp_path):
    """Two session servers (the cache-off reference and k3 with int8 checkpoints, the default); the
    CLI flushes the k3 server's cache, so its restores come from this workload alone."""
    ref, int8 = server_factory("nocache"), server_factory("k3_int8")
    out = tmp_path / "out"
    code = cf.main(
        [
            "--requests",
            "6",
            "--max-new-tokens",
            "8",
            "--seed",
            "3",
            "--batch-size",
            "3",
            "--system-len",
            "70,130",
            "--user-len",
            "4,16",
            "--dtypes",
            "int8",
            "--reference-url",
            ref.url,
            "--k3-url",
            f"int8={int8.url}",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0  # no request without a restore flipped
    res = json.loads((out / "results.json").read_text())
    assert (out / "checkpoint_flips.png").stat().st_size > 10_000
    assert res["config"]["seed"] == 3 and res["git"]["commit"]
    assert list(res["conditions"]) == ["int8", cf.NOISE]
    n_prompt = res["workload"]["prompt_tokens"]
    assert sum(r["prompt_len"] for r in res["workload"]["requests"]) == n_prompt
    for c in res["conditions"].values():
        assert c["compared_requests"] == 6
        assert sum(b["positions"] for b in c["buckets"]) == c["positions_counted"]
        assert (
            sum(b["flips"] for b in c["buckets"]) == c["flips"] == len([d for d in c["flip_details"] if d["exposed"]])
        )
        assert c["positions_counted"] <= c["exposed_output_positions"] == 8 * c["exposed_requests"]
        assert c["unexposed_flips"] == 0
    c = res["conditions"]["int8"]
    # the workload's second occurrences restored from int8 checkpoints
    assert c["exposed_requests"] >= 1 and c["restored_output_positions"] == 8 * c["exposed_requests"]
    assert 0 < c["restored_prompt_tokens"] < n_prompt
    assert c["k3_restore_len_reported"] == 6
    assert res["k3_cache_stats"]["int8"]["checkpoint_dtype"] == "int8"
    # a restore from an int8 checkpoint moves logprobs by more than the server's own batching does
    # (no upper bound here: this very workload moves one first-token margin by 2.7 nats, see
    # benchmarks/results/checkpoint_flips/SUMMARY.md)
    noise = res["conditions"][cf.NOISE]
    assert noise["exposed_requests"] == 6 and noise["agreeing_positions"] > 0
    assert math.isfinite(c["max_abs_logprob_diff_agreeing"])
    assert c["max_abs_logprob_diff_agreeing"] > noise["max_abs_logprob_diff_agreeing"]
    where = c["max_abs_logprob_diff_where"]
    assert where["key"] in {r["key"] for r in res["workload"]["requests"]} and 0 <= where["position"] < 8
