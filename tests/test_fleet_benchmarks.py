"""The fleet's benchmarks end to end, small: the fleet replay (simulated time, real cache code),
the live fleet A/B (real instances, router and master) and the burst of long prompts (real
servers with and without admission budgets); plus the router models the replay uses."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from needs_mooncake import needs_mooncake

from benchmarks.fleet.routing import CacheAware, RoundRobin, SessionRing
from benchmarks.fleet.sim import sessions_of

TRACE = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mooncake_conversation_trace.jsonl")
)


def test_round_robin_rotates():
    rr = RoundRobin(3)
    assert [rr.route(i, [1], 0, [0, 0, 0]) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_session_ring_is_sticky_and_spreads_secondaries():
    ring = SessionRing(4)
    prim = {s: ring.route(0, [], s, [0] * 4) for s in range(4000)}
    assert all(ring.route(0, [9], s, [5, 0, 0, 0]) == prim[s] for s in range(0, 4000, 97))  # load-blind, sticky
    share = Counter(prim.values())
    assert min(share.values()) > 4000 / 4 * 0.7, share
    # a session's secondary: the next other instance clockwise; one instance's sessions spread
    # their secondaries over all three others
    import bisect

    from benchmarks.fleet.routing import _h64

    def secondary(s):
        j = bisect.bisect_left(ring.pos, _h64(f"session-{s}"))
        first = ring.owner[j % len(ring.owner)]
        while ring.owner[j % len(ring.owner)] == first:
            j += 1
        return ring.owner[j % len(ring.owner)]

    sec = Counter(secondary(s) for s, p in prim.items() if p == 0)
    assert set(sec) == {1, 2, 3} and min(sec.values()) > sum(sec.values()) / 3 * 0.6, sec


def test_cache_aware_follows_the_prefix_until_the_load_is_imbalanced():
    ca = CacheAware(3)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert ca.route(0, a, 0, [0, 0, 0]) == 0  # no match: the least loaded, first of equals
    assert ca.route(1, a[:8] + [99, 98], 0, [5, 0, 0]) == 0  # 8/10 > 0.3 matched: its tenant
    assert ca.route(2, [50, 51, 52], 0, [5, 0, 1]) == 1  # no match: the least loaded
    assert ca.route(3, a, 0, [100, 10, 10]) == 1  # 100 - 10 > 64 and 100 > 1.5 x 10: least loaded
    assert ca.route(4, a, 0, [60, 10, 10]) == 1  # the tree now says 1 (the last to touch it)


def test_sessions_follow_the_parent_chain():
    class T:
        parent = [-1, 0, -1, 1, 2, -1]

    assert sessions_of(T()) == [0, 0, 2, 0, 2, 5]


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the shared conversation trace is not present")
def test_fleet_replay_small(tmp_path):
    from benchmarks import fleet_replay

    out = tmp_path / "fr"
    rc = fleet_replay.main(["--limit", "300", "--jobs", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    recs = json.loads((out / "results.json").read_text())
    assert len(recs) == 8  # (single + 3 routings) x (no L3, shared L3)
    assert (out / "hit_rate.png").stat().st_size > 1000
    for r in recs:
        assert 0 < r["hit_rate"] < 1 and r["prompt_tokens"] > 0
        assert abs(r["hit_tokens"] - r["hit_rate"] * r["prompt_tokens"]) < 1e-6 * r["prompt_tokens"]
        assert sum(r["instance_requests"]) == 300
        if r["routing"] != "single":
            assert 0 < r["best_routing_fraction"] <= 1 + 1e-12
    l3 = {r["routing"]: r for r in recs if r["shared_l3"]}
    no = {r["routing"]: r for r in recs if not r["shared_l3"]}
    assert l3["round_robin"]["l3_hit_tokens"] > 0  # turns land on other instances and restore from L3
    assert all(r["l3_hit_tokens"] == 0 for r in no.values())
    assert l3["round_robin"]["hit_rate"] > no["round_robin"]["hit_rate"]


def test_fleet_ab_small(tmp_path, server_factory):
    needs_mooncake()
    pytest.importorskip("sglang_router")
    from conftest import stop_servers_except

    from benchmarks import fleet_ab

    stop_servers_except()  # this starts four servers and a fleet of its own
    out = tmp_path / "fab"
    argv = ["--instances", "2", "--conversations", "3", "--turns", "3", "--first-len", "128", "--user-len", "32"]
    argv += ["--reply-len", "8", "--routings", "round_robin,consistent_hashing", "--no-l3-runs", "--quiet"]
    argv += ["--failover-sessions", "6"]
    assert fleet_ab.main([*argv, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"single", "single_big", "single_big+L3", "round_robin+L3", "consistent_hashing+L3"}
    assert res["errors"] == 0
    assert runs["round_robin+L3"]["l3_hit_tokens"] > 0  # alternating turns restored from Mooncake
    assert all(r["metrics"]["requests"] == 9 for r in runs.values())
    shares = runs["consistent_hashing+L3"]["instance_request_shares"]
    assert abs(sum(shares) - 1) < 1e-9
    assert (out / "fleet_ab.png").stat().st_size > 1000
    fo = res["failover"]["shared_l3"]
    assert fo["failed_requests"] == 0 and fo["survivors"] == 1
    assert sum(fo["moved_to"]) == fo["killed_instance_sessions"] >= 3  # the busier of two holds >= half


def test_fleet_burst_small(tmp_path, server_factory):
    from conftest import stop_servers_except

    from benchmarks import fleet_burst

    stop_servers_except()
    out = tmp_path / "fb"
    argv = ["--longs", "3", "--long-len", "2600", "--alone", "4", "--clients", "2", "--out", str(out)]
    assert fleet_burst.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["errors"] == 0
    for name in ("budgets", "no_budgets"):
        r = res[name]
        assert r["short_burst_requests"] >= 2 and r["long_alone_ttft_s"] > 0
        assert r["long_burst_ttft_p50_s"] >= r["long_alone_ttft_s"] * 0.5
    assert res["bound_s"] > res["budgets"]["short_alone_ttft_p90_s"]
    assert isinstance(res["bound_held"], bool)
