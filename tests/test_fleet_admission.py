"""Admission budgets (:mod:`sglang_k3.fleet.admission`) under random arrivals, releases and
cancellations, plus the fleet's small pieces that need no server: the session table, the per-tier
hit rates, the router launcher's parser and ``scripts/start_fleet.py``'s argument checks."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_k3.config import K3Config
from sglang_k3.fleet.admission import AdmissionControl, AdmissionPolicy, policy_from_config
from sglang_k3.fleet.instance_info import SessionsSeen
from sglang_k3.fleet.status import tier_hit_rates
from sglang_k3.integration.k3_args import add_k3_args, from_namespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

POLICY = AdmissionPolicy(thresholds=(100, 1000), shares=(1.0, 0.5, 0.25), capacity_tokens=2000)


def test_classes_and_budgets():
    p = POLICY
    assert [p.class_of(n) for n in (1, 99, 100, 999, 1000, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert [p.budget(c) for c in range(3)] == [2000, 1000, 500]
    assert [p.class_name(c) for c in range(3)] == ["<100", "100-999", ">=1000"]


@pytest.mark.parametrize(
    "thresholds,shares,capacity,match",
    [
        ((), (1.0,), 10, "at least one threshold"),
        ((10, 5), (1, 1, 1), 10, "ascending"),
        ((0,), (1, 1), 10, "positive"),
        ((10,), (1.0,), 10, "2 classes"),
        ((10,), (1.0, 1.5), 10, r"\(0, 1\]"),
        ((10,), (1.0, 0.0), 10, r"\(0, 1\]"),
        ((10,), (1.0, 0.5), 0, "capacity"),
    ],
)
def test_bad_policies_are_refused(thresholds, shares, capacity, match):
    with pytest.raises(ValueError, match=match):
        AdmissionPolicy(thresholds, shares, capacity)


def test_config_defaults_and_server_capacity():
    assert policy_from_config(K3Config(), 4096) is None
    p = policy_from_config(K3Config(admission_thresholds=(2048,)), 4096)
    assert p.shares == (1.0, 0.5) and p.capacity_tokens == 4096
    p = policy_from_config(K3Config(admission_thresholds=(64, 128), admission_capacity_tokens=500), 4096)
    assert p.shares == (1.0, 0.5, 0.5) and p.capacity_tokens == 500


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--k3-admission-shares", "1", "0.5"], "need --k3-admission-thresholds"),
        (["--k3-admission-thresholds", "10", "--k3-admission-shares", "1"], "2 classes"),
        (["--k3-admission-thresholds", "10", "5"], "ascending"),
        (["--k3-admission-thresholds", "10", "--k3-admission-capacity-tokens", "-1"], ">= 0"),
    ],
)
def test_launch_server_flags_are_checked(argv, match):
    ap = argparse.ArgumentParser()
    add_k3_args(ap)
    with pytest.raises(SystemExit, match=match):
        from_namespace(ap.parse_args(argv))


def test_flags_reach_the_config(monkeypatch):
    ap = argparse.ArgumentParser()
    add_k3_args(ap)
    cfg = from_namespace(ap.parse_args(["--k3-admission-thresholds", "512", "--k3-admission-shares", "1", "0.25"]))
    assert cfg.admission_thresholds == (512,) and cfg.admission_shares == (1.0, 0.25)
    from sglang_k3.config import ENV_CONFIG, from_env

    monkeypatch.delenv(ENV_CONFIG, raising=False)
    cfg.to_env()  # monkeypatch restores the variable afterwards

    assert from_env() == cfg


# ------------------------------------------------------------------ random schedules
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 2500)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    max_size=60,
)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _check(ctl: AdmissionControl, held: dict, waiting: dict) -> None:
    p = ctl.policy
    for c, cs in enumerate(ctl.classes):
        mine = [n for (cls, n) in held.values() if cls == c]
        assert cs.in_flight_tokens == sum(mine) and cs.in_flight_requests == len(mine)
        assert cs.in_flight_tokens <= p.budget(c) or cs.in_flight_requests == 1  # an oversized one alone
        q = [w for w in waiting.values() if w[0] == c]
        assert cs.waiting == len(q)
        if q:  # a waiting head must not fit, or it would have been admitted
            head_n = ctl._waiters[c][0].n
            assert cs.in_flight_requests > 0 and cs.in_flight_tokens + head_n > p.budget(c)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_budgets_hold_under_random_schedules(ops):
    async def run():
        ctl = AdmissionControl(POLICY)
        tasks: dict[str, asyncio.Task] = {}
        arrival: dict[str, int] = {}
        held: dict[str, tuple[int, int]] = {}
        waiting: dict[str, tuple[int, int]] = {}
        granted_order: list[str] = []
        k = 0

        def note_done():
            for rid, t in tasks.items():
                if t.done() and not t.cancelled() and rid in waiting:
                    held[rid] = waiting.pop(rid)
                    granted_order.append(rid)

        for op, arg in ops:
            if op == "arrive":
                rid = f"r{k}"
                k += 1
                arrival[rid] = k
                waiting[rid] = (POLICY.class_of(arg), arg)
                tasks[rid] = asyncio.ensure_future(ctl.acquire(rid, arg))
            elif op == "release" and held:
                rid = sorted(held)[arg % len(held)]
                held.pop(rid)
                ctl.release(rid)
                ctl.release(rid)  # idempotent
            elif op == "cancel" and waiting:
                rid = sorted(waiting)[arg % len(waiting)]
                tasks[rid].cancel()
            await _settle()
            for rid in [r for r in waiting if tasks[r].cancelled()]:
                waiting.pop(rid)
            note_done()
            _check(ctl, held, waiting)
        # first come, first served within a class
        for c in range(POLICY.n_classes):
            mine = [r for r in granted_order if classes[r] == c]
            assert mine == sorted(mine, key=arrival.get)
        # everything released: nothing leaks, every waiter gets in
        while held or waiting:
            for rid in list(held):
                held.pop(rid)
                ctl.release(rid)
            await _settle()
            note_done()
        assert all(cs.in_flight_tokens == 0 and cs.in_flight_requests == 0 and cs.waiting == 0 for cs in ctl.classes)
        assert not ctl._held

    classes: dict[str, int] = {}  # every arrival's class, for the FIFO check
    k = 0
    for op, arg in ops:
        if op == "arrive":
            classes[f"r{k}"] = POLICY.class_of(arg)
            k += 1
    asyncio.run(run())


def test_a_cancelled_waiter_unblocks_the_ones_behind_it():
    async def run():
        ctl = AdmissionControl(AdmissionPolicy((100,), (1.0, 0.5), 1000))
        await ctl.acquire("a", 400)  # class 1, budget 500
        big = asyncio.ensure_future(ctl.acquire("big", 450))
        small = asyncio.ensure_future(ctl.acquire("small", 100))
        await _settle()
        assert not big.done() and not small.done()  # small waits behind big (FIFO)
        big.cancel()
        await _settle()
        assert small.done() and ctl.holds("small") and not ctl.holds("big")
        assert ctl.classes[1].waited == 1 and ctl.classes[1].waiting == 0
        ctl.release("a")
        ctl.release("small")
        assert ctl.classes[1].in_flight_tokens == 0

    asyncio.run(run())


def test_short_requests_never_wait_for_long_ones():
    async def run():
        ctl = AdmissionControl(AdmissionPolicy((100,), (1.0, 0.5), 1000))
        await ctl.acquire("long0", 5000)  # oversized: admitted alone
        queued = [asyncio.ensure_future(ctl.acquire(f"long{i}", 300)) for i in range(1, 4)]
        await _settle()
        assert not any(t.done() for t in queued)
        for i in range(20):
            await asyncio.wait_for(ctl.acquire(f"s{i}", 40), timeout=1)
        assert ctl.classes[0].waited == 0 and ctl.classes[1].oversized == 1
        ctl.release("long0")
        await _settle()
        assert sum(t.done() for t in queued) == 1  # 300 fits in 500; the next 300 does not
        st_ = ctl.stats()
        assert st_["classes"][1]["peak_in_flight_tokens"] == 5000 and st_["classes"][1]["waiting"] == 2
        for t in queued:
            t.cancel()

    asyncio.run(run())


# ------------------------------------------------------------------ the other fleet pieces
def test_sessions_seen_counts_a_window_and_forgets_the_oldest():
    now = [1000.0]
    s = SessionsSeen(max_keys=3, clock=lambda: now[0])
    for i, k in enumerate(["a", "b", "a", "c"]):
        now[0] = 1000.0 + i
        s.note(k)
    assert s.held(window_s=10) == 3 and s.requests_with_key == 4
    assert s.held(window_s=1.5) == 2  # a (t=1002) and c (t=1003)
    now[0] = 1004.0
    s.note("d")  # over max_keys: b, the least recently seen, goes
    assert sorted(s.keys(100)) == ["a", "c", "d"]
    with pytest.raises(ValueError):
        SessionsSeen(max_keys=0)


def test_tier_hit_rates_split_the_hits():
    k3 = {"requested_tokens": 1000, "hit_tokens": 600, "tier_host_hit_tokens": 100, "tier_l3_hit_tokens": 50}
    h = tier_hit_rates(k3)
    assert (h["device"], h["host"], h["l3"], h["total"]) == (0.45, 0.1, 0.05, 0.6)
    assert tier_hit_rates({})["total"] == 0.0


def test_the_router_launcher_offers_consistent_hashing():
    pytest.importorskip("sglang_router")
    from sglang_k3.fleet.launch_router import parse

    ra = parse(["--worker-urls", "http://127.0.0.1:1", "--policy", "consistent_hashing", "--retry-max-retries", "3"])
    assert ra.policy == "consistent_hashing" and ra.retry_max_retries == 3
    assert parse(["--worker-urls", "http://127.0.0.1:1"]).policy == "cache_aware"  # the router's default
    with pytest.raises(SystemExit):
        parse(["--policy", "prefix_hash"])


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--instances", "0"], "--instances"),
        (["--segment", "lots"], "not a size"),
        (["--segment", "1mb"], "at least 16mb"),
        (["--admission-thresholds", "--admission-shares", "1", "0.5"], "needs --admission-thresholds"),
        (["--router-port", "70000"], "TCP port"),
        (["--store-segment", "1mb"], "0 or at least 16mb"),
    ],
)
def test_start_fleet_refuses_bad_arguments(argv, match, capsys):
    import start_fleet

    ap = start_fleet.build_parser()
    with pytest.raises(SystemExit):
        start_fleet.spec_from_args(ap.parse_args(argv), ap)
    assert match in capsys.readouterr().err


def test_start_fleet_builds_the_instances_flags():
    import start_fleet

    ap = start_fleet.build_parser()
    spec = start_fleet.spec_from_args(
        ap.parse_args(["--instances", "3", "--segment", "64mb", "--", "--k3-checkpoint-dtype", "fp32"]), ap
    )
    assert spec.instances == 3 and spec.segment_bytes == 64 << 20 and spec.shared_l3
    assert spec.store_segment_bytes == 1 << 30
    assert spec.instance_args == ("--k3-admission-thresholds", "2048", "--k3-checkpoint-dtype", "fp32")
    assert start_fleet.spec_from_args(ap.parse_args(["--store-segment", "0"]), ap).store_segment_bytes == 0
    spec = start_fleet.spec_from_args(ap.parse_args(["--admission-thresholds", "--no-shared-l3"]), ap)
    assert spec.instance_args == () and not spec.shared_l3
