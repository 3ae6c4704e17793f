"""A real fleet: a real ``mooncake_master`` with a store client holding the pool, three real
``sglang_k3.launch_server`` instances on the embedded model (fp32 checkpoints, so greedy tokens
must equal the cache-off server's exactly) and a real sglang-router in front (``LocalFleet``, what
``scripts/start_fleet.py`` starts).

Which instance served a request is read from the instances themselves: each one lists the session
keys (``X-SMG-Routing-Key``) it was sent (``GET /k3_fleet_info?list_keys=true``).

The module ends with an instance killed, so that test runs last. Skipped without the Mooncake wheel.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import requests
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()
pytest.importorskip("sglang_router")

from conftest import stop_servers_except  # noqa: E402
from server_utils import k3_state  # noqa: E402
from workloads import random_tokens  # noqa: E402

from sglang_k3.fleet.local_fleet import FleetSpec, LocalFleet  # noqa: E402
from sglang_k3.fleet.status import fleet_status, format_table  # noqa: E402

SEED = 4242
INSTANCE_ARGS = ("--k3-checkpoint-dtype", "fp32", "--k3-admission-thresholds", "2048")
NEW = 6


@pytest.fixture(scope="module")
def fleet(server_factory):
    stop_servers_except("nocache")
    plain = server_factory("nocache")
    f = LocalFleet(FleetSpec(instances=3, policy="consistent_hashing", instance_args=INSTANCE_ARGS)).start()
    try:
        yield f, plain
    finally:
        f.stop()


def _send(url: str, ids: list[int], key: str) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, headers={"X-SMG-Routing-Key": key}, timeout=300)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    return r.json()


def _served_by(f: LocalFleet, key: str) -> list[str]:
    return [url for url, keys in f.session_keys(timeout=30).items() if key in keys]


def test_sessions_stick_to_one_instance_and_spread_over_the_fleet(fleet):
    f, plain = fleet
    rng = random.Random(SEED)
    system = random_tokens(rng, 128)
    convs = {f"stick-{i}": system + random_tokens(rng, rng.randint(40, 120)) for i in range(12)}
    for turn in range(2):
        for key, ids in convs.items():
            out = _send(f.url, ids, key)
            assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"], (key, turn)
            if turn:
                assert out["meta_info"]["cached_tokens"] >= len(ids) - 200, (key, out["meta_info"])
            convs[key] = ids + out["output_ids"] + random_tokens(rng, rng.randint(20, 60))
    owners = {key: _served_by(f, key) for key in convs}
    assert all(len(v) == 1 for v in owners.values()), owners
    per_instance = Counter(v[0] for v in owners.values())
    assert len(per_instance) >= 2, per_instance  # 12 sessions over 3 instances by a hash ring
    table = format_table(fleet_status(f.url))
    print("\n" + table)
    for srv in f.instances:
        assert srv.url in table


def test_a_conversation_alternating_between_instances_hits_on_each(fleet):
    """The router rotates (round_robin): each turn lands on the next instance, which has not
    seen the previous turn. It restores it from the shared Mooncake tier."""
    f, plain = fleet
    f.start_router("round_robin")
    try:
        rng = random.Random(SEED + 1)
        ids = random_tokens(rng, 200)
        cached_on: dict[str, int] = {}
        for turn in range(6):
            key = f"alt-{turn}"
            out = _send(f.url, ids, key)
            assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"], turn
            (owner,) = _served_by(f, key)
            if turn:
                cached_on[owner] = cached_on.get(owner, 0) + out["meta_info"]["cached_tokens"]
            ids = ids + out["output_ids"] + random_tokens(rng, rng.randint(30, 60))
        assert len(cached_on) == 3, cached_on  # turns 1..5 rotate over all three instances
        assert all(v > 0 for v in cached_on.values()), cached_on
        l3_hits = sum(k3_state(s)["tier_l3_hit_tokens"] for s in f.instances)
        assert l3_hits > 0
    finally:
        f.start_router("consistent_hashing")


def test_fleet_status_reports_every_instance(fleet):
    f, _ = fleet
    st = fleet_status(f.url)
    assert {row["url"] for row in st["instances"]} == {s.url for s in f.instances}
    for row in st["instances"]:
        assert row["up"] and row["router_healthy"]
        assert row["admission"]["thresholds"] == [2048]
        h = row["hit_rates"]
        assert 0.0 <= h["device"] + h["host"] + h["l3"] <= 1.0 + 1e-9
    assert sum(row["sessions_held"] for row in st["instances"]) >= 12


def _admission(srv) -> dict:
    return requests.get(srv.url + "/k3_fleet_info", timeout=30).json()["admission"]


def test_a_burst_of_long_prompts_waits_in_its_class_while_short_ones_pass(fleet):
    """Each instance runs --k3-admission-thresholds 2048 with its prefill chunk (4096) as the
    capacity: prompts of 2048 tokens or more may hold 2048 tokens in flight, so 2,500-token
    prompts run one at a time, and short prompts sent during the burst never wait for them."""
    import concurrent.futures as cf

    f, plain = fleet
    srv = next(s for s in f.instances if s.alive())
    rng = random.Random(SEED + 3)
    longs = [random_tokens(rng, 2500) for _ in range(4)]
    shorts = [random_tokens(rng, 60) for _ in range(6)]
    before = _admission(srv)
    with cf.ThreadPoolExecutor(10) as ex:
        futs = [ex.submit(srv.generate, ids, 2) for ids in longs]
        futs += [ex.submit(srv.generate, ids, 2) for ids in shorts]
        outs = [fu.result() for fu in futs]
    for ids, out in zip(longs + shorts, outs):
        assert out["output_ids"] == plain.generate(ids, 2)["output_ids"]
    after = _admission(srv)
    short_cls, long_cls = after["classes"]
    assert long_cls["budget_tokens"] == 2048 and long_cls["peak_in_flight_tokens"] == 2500  # one at a time
    assert long_cls["admitted"] - before["classes"][1]["admitted"] == 4
    assert long_cls["oversized"] - before["classes"][1]["oversized"] == 4
    assert long_cls["waited"] - before["classes"][1]["waited"] >= 2  # sent together, run in turn
    assert short_cls["waited"] == before["classes"][0]["waited"]  # never behind the long class
    assert long_cls["in_flight_tokens"] == 0 and short_cls["in_flight_tokens"] == 0  # all given back


def test_a_killed_instance_s_sessions_continue_on_their_secondaries(fleet):
    """Runs last: it kills an instance. Every request still succeeds with the cache-off server's
    tokens; the dead instance's sessions move to the others (the re-prefill is spread, and the
    spread is printed)."""
    f, plain = fleet
    rng = random.Random(SEED + 2)
    convs = {f"kill-{i}": random_tokens(rng, rng.randint(100, 200)) for i in range(30)}
    for key, ids in convs.items():
        out = _send(f.url, ids, key)
        convs[key] = ids + out["output_ids"] + random_tokens(rng, 30)
    before = {key: _served_by(f, key)[0] for key in convs}
    victim_url = Counter(before.values()).most_common(1)[0][0]
    victim = next(s for s in f.instances if s.url == victim_url)
    moved = [k for k, u in before.items() if u == victim_url]
    victim.stop()
    moved_cached = 0
    for key, ids in convs.items():
        out = _send(f.url, ids, key)
        assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"], key
        if key in moved:
            moved_cached += out["meta_info"]["cached_tokens"]
    after = f.session_keys(timeout=30)
    landed = Counter(next(u for u, keys in after.items() if k in keys) for k in moved)
    stayed = [k for k, u in before.items() if u != victim_url and k not in after[u]]
    print(f"\nkilled {victim_url} holding {len(moved)} of {len(convs)} sessions; they moved to {dict(landed)}")
    assert sum(landed.values()) == len(moved)
    assert victim_url not in landed
    assert not stayed, stayed  # the other sessions kept their primary
    assert len(landed) == 2, landed  # the re-prefill spread over both survivors
    # the pool is held by a store client, not the victim: the moved sessions restore their first turn
    assert moved_cached >= 64 * len(moved), moved_cached
