"""A real disaggregated fleet (issue #35): one prefill and one decode ``sglang_k3.launch_server``
on the embedded model, a real sglang-router with ``--pd-disaggregation`` in front, each request's
MLA KV and KDA state carried from prefill to decode by Mooncake's transfer engine over TCP
(``LocalFleet`` with ``prefill``/``decode``, what ``scripts/start_fleet.py --pd`` starts).

The k3 cache serves on the prefill side with fp32 checkpoints, so greedy tokens through the PD
fleet must equal the single cache-off server's exactly, turn for turn; later turns report the
prefill's hits. Skipped without the Mooncake wheel (CI has it).
"""

from __future__ import annotations

import random

import pytest
import requests
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()
pytest.importorskip("sglang_router")

from conftest import stop_servers_except  # noqa: E402
from server_utils import k3_state  # noqa: E402
from workloads import random_tokens  # noqa: E402

from sglang_k3.fleet.local_fleet import FleetSpec, LocalFleet  # noqa: E402

SEED = 3535
NEW = 8


@pytest.fixture(scope="module")
def pd_fleet(server_factory):
    stop_servers_except("nocache")
    plain = server_factory("nocache")
    spec = FleetSpec(
        prefill=1,
        decode=1,
        shared_l3=False,
        policy="round_robin",
        instance_args=("--k3-checkpoint-dtype", "fp32"),
    )
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


def test_a_conversation_through_the_pd_fleet_equals_one_cache_off_server(pd_fleet):
    """Three conversations of four turns over a shared system prompt, interleaved. Every answer
    equals the cache-off server's token for token (the KV and the KDA state crossed intact), and
    every later turn restores on the prefill side at least up to the 64-token state grid point
    below the previous prompt's end, where the prefill left a state (the previous answer was
    generated on the decode side, which hands nothing back yet: issue #35)."""
    f, plain = pd_fleet
    prefill = f.instances[0]
    rng = random.Random(SEED)
    system = random_tokens(rng, 256)
    convs = [system + random_tokens(rng, rng.randint(40, 90)) for _ in range(3)]
    before = k3_state(prefill)
    cached, sent = [], [0] * len(convs)  # sent[c]: conversation c's previous prompt length
    for turn in range(4):
        for c in range(len(convs)):
            ids = convs[c]
            out = _send(f.url, ids)
            assert out["output_ids"] == plain.generate(ids, NEW)["output_ids"], (turn, c)
            got = out["meta_info"]["cached_tokens"]
            cached.append(got)
            if turn:
                assert got >= sent[c] // 64 * 64, (turn, c, got, sent[c])
            sent[c] = len(ids)
            convs[c] = ids + out["output_ids"] + random_tokens(rng, rng.randint(20, 50))
    after = k3_state(prefill)
    assert after["hit_tokens"] - before["hit_tokens"] >= sum(cached) > 0, (after, before)
