"""Two real ``sglang_k3.launch_server`` instances sharing one real ``mooncake_master`` (TCP on
loopback): a prefix computed on one is restored on the other, a conversation alternating between
them hits on both, and the faults of the shared tier (the master killed and restarted, an
instance holding part of the pool killed) cost hits, never correctness.

Both run ``--k3-mooncake --k3-tier-write-policy write_through`` (a boundary is in the shared tier
as soon as it is stored, not only once evicted) with fp32 checkpoints, so greedy tokens must equal
the cache-off server's exactly. The second instance serves KV pages of 64 tokens, the first pages
of one: what either saved, the other restores (tier objects do not depend on the page size). The
second also has a host tier above Mooncake, so a request whose prefix only Mooncake holds waits in
the queue while it is copied up, and is then restored from host memory.
Skipped without the Mooncake wheel.
"""

from __future__ import annotations

import random
import time

import pytest
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()

from server_utils import Server, k3_state  # noqa: E402
from workloads import random_tokens  # noqa: E402

from sglang_k3.tiers.mooncake_master import MooncakeMaster  # noqa: E402

SEED = 9090
FLAGS = ["--k3-checkpoint-dtype", "fp32", "--k3-mooncake", "--k3-tier-write-policy", "write_through"]


@pytest.fixture(scope="module")
def fleet(server_factory):
    master = MooncakeMaster().start()
    env = master.client_env(128 << 20)
    b_flags = [*FLAGS, "--page-size", "64", "--k3-host-tier-gib", "0.25"]
    a, b = Server("mooncake_a", FLAGS, env=env), Server("mooncake_b_page64_host", b_flags, env=env)
    try:
        a.launch()
        b.launch()
        a.wait_healthy()
        b.wait_healthy()
        yield master, a, b, server_factory("nocache")
    finally:
        for s in (a, b):
            s.stop()
        master.stop()


def _conversation(rng: random.Random, system: list[int]) -> list[int]:
    return system + random_tokens(rng, rng.randint(60, 160))


def test_a_prefix_computed_on_one_instance_is_restored_on_the_other(fleet):
    master, a, b, plain = fleet
    rng = random.Random(SEED)
    prompt = _conversation(rng, random_tokens(rng, 150))
    out_a = a.generate(prompt, 8)
    nxt = prompt + out_a["output_ids"] + random_tokens(rng, 40)
    before = k3_state(b)
    out_b = b.generate(nxt, 8)
    after = k3_state(b)
    assert out_b["meta_info"]["cached_tokens"] >= len(prompt) - 64, out_b["meta_info"]
    # only Mooncake held it: B held the request back while its prefetch thread copied the prefix
    # into host memory, and the admission restored it from there, not over the network
    # (patches/scheduler_hold_tier_loads.py; without the hold the load reads Mooncake)
    assert after["tier_held"] == before["tier_held"] + 1, str({k: v for k, v in after.items() if k.startswith("tier")})
    # it was all B had to run: its scheduler waited for the copy instead of spinning
    assert after["tier_hold_waits"] > before["tier_hold_waits"]
    assert after["tier_host_hits"] == before["tier_host_hits"] + 1
    assert after["tier_prefetch_hits"] == before["tier_prefetch_hits"] + 1
    assert after["tier_l3_hits"] == before["tier_l3_hits"]
    assert out_b["output_ids"] == plain.generate(nxt, 8)["output_ids"]
    assert out_a["output_ids"] == plain.generate(prompt, 8)["output_ids"]


def test_a_conversation_alternating_between_instances_hits_on_both(fleet):
    _, a, b, plain = fleet
    rng = random.Random(SEED + 1)
    system = random_tokens(rng, 120)
    convs = [_conversation(rng, system) for _ in range(3)]
    cached = {a.name: 0, b.name: 0}
    for turn in range(4):
        for c in range(len(convs)):
            srv = (a, b)[(turn + c) % 2]
            out = srv.generate(convs[c], 6)
            ref = plain.generate(convs[c], 6)
            assert out["output_ids"] == ref["output_ids"], (turn, c, srv.name)
            if turn > 0:
                cached[srv.name] += out["meta_info"]["cached_tokens"]
            convs[c] = convs[c] + out["output_ids"] + random_tokens(rng, rng.randint(20, 60))
    assert cached[a.name] > 0 and cached[b.name] > 0, cached
    for srv in (a, b):
        st = k3_state(srv)
        assert st["tier_invalid_objects"] == 0 and st["tier_errors"] == 0


def test_the_master_killed_mid_workload_costs_hits_not_correctness(fleet):
    master, a, b, plain = fleet
    rng = random.Random(SEED + 2)
    prompt = _conversation(rng, random_tokens(rng, 100))
    master.stop(kill=True)
    errors_before = k3_state(a)["tier_l3_errors"]
    for srv in (a, b, a):  # both keep serving from their own device cache
        out = srv.generate(prompt, 6)
        assert out["output_ids"] == plain.generate(prompt, 6)["output_ids"]
        prompt = prompt + out["output_ids"] + random_tokens(rng, 30)
    assert k3_state(a)["tier_l3_errors"] > errors_before  # counted, not raised
    master.start()  # same ports, empty
    # once the clients re-mount their segments, a prefix computed on A is found on B again
    deadline, hit = time.time() + 90, 0
    while time.time() < deadline and not hit:
        p = _conversation(rng, random_tokens(rng, 100))
        out_a = a.generate(p, 6)
        nxt = p + out_a["output_ids"] + random_tokens(rng, 30)
        out_b = b.generate(nxt, 6)
        assert out_b["output_ids"] == plain.generate(nxt, 6)["output_ids"]
        hit = out_b["meta_info"]["cached_tokens"]
        if not hit:
            time.sleep(2)
    assert hit >= len(p) - 64


def test_an_instance_holding_part_of_the_pool_dies(fleet):
    """Objects live in the memory of the instance that contributed the segment: when A dies, B
    finds part of what A wrote gone. It misses there and recomputes; nothing fails."""
    master, a, b, plain = fleet
    rng = random.Random(SEED + 3)
    prompts = [_conversation(rng, random_tokens(rng, 100)) for _ in range(4)]
    outs = [a.generate(p, 6)["output_ids"] for p in prompts]
    a.stop()
    time.sleep(12)  # past the master's client_ttl (10 s): A's segment is dropped
    before = k3_state(b)
    for p, o in zip(prompts, outs):
        nxt = p + o + random_tokens(rng, 30)
        out = b.generate(nxt, 6)
        assert out["output_ids"] == plain.generate(nxt, 6)["output_ids"]
    after = k3_state(b)
    assert after["tier_invalid_objects"] == before["tier_invalid_objects"] and after["tier_errors"] == 0
