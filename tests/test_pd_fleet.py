"""A real disaggregated fleet (issue #35): a real ``mooncake_master`` with a store client holding
the pool, one prefill and one decode ``sglang_k3.launch_server`` on the embedded model, a real
sglang-router with ``--pd-disaggregation`` in front, each request's MLA KV and KDA state carried
from prefill to decode by Mooncake's transfer engine over TCP (``LocalFleet`` with
``prefill``/``decode``, what ``scripts/start_fleet.py --pd`` starts). The decode side writes each
finished turn's boundary through to the shared Mooncake store; the prefill side restores it.

fp32 checkpoints, so greedy tokens through the PD fleet must equal the single cache-off server's
exactly, turn for turn. Skipped without the Mooncake wheel (CI has it).
"""

from __future__ import annotations

import random

import pytest
import requests
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()
pytest.importorskip("sglang_router")

from conftest import stop_servers_except  # noqa: E402
from server_utils import k3_state, wait_untracked  # noqa: E402
from workloads import random_tokens  # noqa: E402

from sglang_k3.fleet.local_fleet import FleetSpec, LocalFleet  # noqa: E402

SEED = 3535
NEW = 32


@pytest.fixture(scope="module")
def pd_fleet(server_factory):
    stop_servers_except("nocache")
    plain = server_factory("nocache")
    spec = FleetSpec(prefill=1, decode=1, policy="round_robin", instance_args=("--k3-checkpoint-dtype", "fp32"))
    f = LocalFleet(spec).start()
    try:
        yield f, plain
    finally:
        f.stop()


def _send(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, (r.status_code, r.text[:500])
    return r.json()


def test_the_router_runs_in_pd_mode_over_one_prefill_and_one_decode(pd_fleet):
    f, _ = pd_fleet
    prefill, decode = f.instances
    assert "--pd-disaggregation" in f.router.command
    assert f.router.command.count("--prefill") == 1 and f.router.command.count("--decode") == 1
    assert f.bootstrap_ports == {
        prefill.name: int(prefill.args[prefill.args.index("--disaggregation-bootstrap-port") + 1])
    }
    assert {w["url"] for w in f.router.workers()} == {prefill.url, decode.url}
    # both sides keep unified memory: the transfer moves whole pages and slots of its one buffer
    assert all(k3_state(s)["memory_budget_bytes"] > 0 for s in (prefill, decode))


def test_a_conversation_through_the_pd_fleet_equals_one_cache_off_server(pd_fleet):
    """Three conversations of four turns over a shared system prompt, interleaved. Every answer
    equals the cache-off server's token for token (the KV and the KDA state crossed intact, both
    ways). Every later turn restores its previous prompt and the answer the decode side generated,
    to the token (the prefill alone holds states up to the previous prompt's end only, 32 tokens
    short): the decode instance wrote that turn's end through to Mooncake and the prefill instance
    loaded it from there."""
    f, plain = pd_fleet
    prefill, decode = f.instances
    rng = random.Random(SEED)
    system = random_tokens(rng, 256)
    convs = [system + random_tokens(rng, rng.randint(40, 90)) for _ in range(3)]
    before = {s.name: k3_state(s) for s in (prefill, decode)}
    cached, turn_end = [], [0] * len(convs)  # turn_end[c]: conversation c's last prompt + answer
    for turn in range(4):
        for c in range(len(convs)):
            ids = convs[c]
            out = _send(f.url, ids)
            assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"], (turn, c)
            got = out["meta_info"]["cached_tokens"]
            cached.append(got)
            if turn:
                assert got >= turn_end[c] - 1, (turn, c, got, turn_end[c])
            turn_end[c] = len(ids) + NEW
            convs[c] = ids + out["output_ids"] + random_tokens(rng, rng.randint(20, 50))
    pre, dec = k3_state(prefill), k3_state(decode)
    assert pre["hit_tokens"] - before[prefill.name]["hit_tokens"] >= sum(cached) > 0
    # the answers came back through the L3: written by decode, read by prefill
    assert dec["tier_saves"] - before[decode.name]["tier_saves"] >= 9, dec
    assert pre["tier_l3_hits"] - before[prefill.name]["tier_l3_hits"] >= 9, pre


def test_a_decode_instance_that_dies_fails_its_requests_cleanly_and_the_fleet_recovers(pd_fleet):
    """Runs last (it kills the decode instance). A request in flight when the decode instance dies
    gets an error from the router within a minute, not a hang; the prefill instance stays healthy
    with no request left tracked. Once decode is back on its URL, the router routes to it again
    and the conversation goes on with the cache-off server's greedy tokens, restoring the turn
    decode handed back before it died."""
    import threading
    import time

    f, plain = pd_fleet
    prefill, decode = f.instances
    rng = random.Random(SEED + 1)
    ids = random_tokens(rng, 300)
    first = _send(f.url, ids)["output_ids"]
    ids = ids + first + random_tokens(rng, 20)
    got: dict = {}

    def in_flight() -> None:
        t0 = time.time()
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}
        try:
            r = requests.post(f.url + "/generate", json=body, timeout=300)
            got["status"] = r.status_code
        except requests.RequestException as e:
            got["status"] = type(e).__name__
        got["seconds"] = time.time() - t0

    th = threading.Thread(target=in_flight)
    th.start()
    time.sleep(1.5)
    decode.stop()
    th.join(timeout=200)
    assert not th.is_alive() and got["status"] != 200 and got["seconds"] < 90, got
    assert requests.get(prefill.url + "/health", timeout=60).status_code == 200
    assert wait_untracked(prefill, timeout=60, poll=1)["tracked_requests"] == 0
    decode.launch().wait_healthy()
    deadline = time.time() + 60
    while decode.url not in f.router.healthy_urls() and time.time() < deadline:
        time.sleep(1)
    out = _send(f.url, ids)
    assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"]
    assert out["meta_info"]["cached_tokens"] >= 300 + NEW - 1, out["meta_info"]
