"""The Mooncake (L3) tier against a real ``mooncake_master`` on loopback (TCP), no SGLang server:
the store's semantics as the tier relies on them, boundaries saved and loaded through it, bad
objects rejected, a full segment refusing softly, and a master killed and restarted.

Skipped when the Mooncake wheel is not installed (``pip install mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from needs_mooncake import needs_mooncake  # noqa: E402

needs_mooncake()

from tier_pools import Pools  # noqa: E402

from sglang_k3.tiers.keys import Namespace, block_hashes, boundary_key  # noqa: E402
from sglang_k3.tiers.manager import TierManager  # noqa: E402
from sglang_k3.tiers.mooncake_master import MooncakeMaster  # noqa: E402
from sglang_k3.tiers.mooncake_store import MooncakeStore  # noqa: E402

SEED = 777


def _config(master: MooncakeMaster, segment: int):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

    return MooncakeStoreConfig(
        local_hostname="127.0.0.1",
        metadata_server=master.metadata_url,
        global_segment_size=segment,
        protocol="tcp",
        device_name="",
        master_server_address=master.master_address,
        master_metrics_port=master.metrics_port,
        check_server=False,
        standalone_storage=False,
        client_server_address="",
    )


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def store(master):
    s = MooncakeStore(_config(master, 64 << 20), local_buffer_bytes=16 << 20)
    yield s
    s.close()


def _ns(tag: str) -> Namespace:
    return Namespace(model=f"m-{tag}", tokenizer="t", layout="L")


def test_store_semantics_the_tier_relies_on(store):
    assert store.put("k3test:a", b"first") and store.get("k3test:a") == b"first"
    assert store.put("k3test:a", b"second")  # immutable: succeeds, does not write
    assert store.get("k3test:a") == b"first"
    assert store.exists(["k3test:a", "k3test:none"]) == [True, False]
    assert store.get("k3test:none") is None
    assert store.counters.errors == 0


def test_boundaries_round_trip_through_mooncake(store):
    p = Pools(SEED)
    mgr = TierManager([store], _ns("rt"), p.io)
    toks = [random.Random(SEED).randrange(32, 127) for _ in range(300)]
    kv = p.fresh_kv(300)
    h = p.checkpoint(1)
    assert mgr.save(toks, kv, 250, h, kind=4) and mgr.counters.saves == 1
    plan = mgr.find(toks, 0, 299, 0)
    assert plan is not None and plan.pos == 250 and plan.store is store
    new_kv = p.fresh_kv(250)
    (h2,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h2) == 4
    for layer in p.kv:
        assert torch.equal(layer[new_kv], layer[kv[:250]])
    assert torch.equal(p.pool.q[h2], p.pool.q[h]) and torch.equal(p.pool.scale[h2], p.pool.scale[h])
    assert mgr.hits_by_tier["l3"] == 1


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_tokenizer"])
def test_a_bad_object_in_mooncake_is_rejected(store, damage):
    """Mooncake keeps what was put first under a key: a bad object written first (by a buggy or
    foreign writer) stays there and must be refused at every read; the boundary below it, whole
    and valid, still loads."""
    p = Pools(SEED)
    ns = _ns(f"bad-{damage}")
    mgr = TierManager([store], ns, p.io)
    toks = [random.Random(SEED + 1).randrange(32, 127) for _ in range(150)]
    kv = p.fresh_kv(150)
    assert mgr.save(toks, kv, 64, p.checkpoint(0))  # a valid boundary at 64 (and KV block 0)
    other = TierManager([store], _ns(f"other-{damage}"), p.io)  # a valid object, another namespace
    other.save(toks, kv, 100, p.checkpoint(1))
    good = store.get(boundary_key(other.ns, toks, 100, block_hashes(toks, 100)))
    if damage == "garbage":
        bad = random.Random(SEED).randbytes(len(good))
    elif damage == "truncated":
        bad = good[: len(good) // 2]
    else:  # valid bytes written for another tokenizer's key, stored under this one
        bad = good
    key = boundary_key(ns, toks, 100, block_hashes(toks, 100))
    assert store.put(key, bad)
    plan = mgr.find(toks, 0, 149, 0)
    assert plan is not None and plan.pos == 100  # found: it exists
    (h,) = p.pool.alloc(1)
    new_kv = p.fresh_kv(100)
    before = [layer[new_kv].clone() for layer in p.kv]
    assert mgr.load(plan, new_kv, h) is None  # ... but never restored
    assert mgr.counters.invalid_objects == 1
    assert all(torch.equal(layer[new_kv], b) for layer, b in zip(p.kv, before))
    below = mgr.find(toks, 0, plan.pos - 1, 0)  # what the lifecycle tries next
    assert below is not None and below.pos == 64
    assert mgr.load(below, p.fresh_kv(64), h) == 0


def test_a_full_pool_refuses_softly():
    """A pool whose only segment (16 MB, Mooncake's smallest that mounts here) cannot hold an
    object refuses the put with a count, not an exception; smaller objects still go in."""
    m = MooncakeMaster().start()
    s = MooncakeStore(_config(m, 16 << 20), local_buffer_bytes=64 << 20, name="small")
    try:
        assert not s.put("k3test:too-big", bytes(32 << 20))
        assert s.counters.put_refused == 1 and s.counters.errors == 0
        assert s.put("k3test:fits", bytes(1 << 20))
    finally:
        s.close()
        m.stop()


def test_master_killed_then_restarted():
    m = MooncakeMaster().start()
    s = MooncakeStore(_config(m, 16 << 20), local_buffer_bytes=16 << 20)
    try:
        assert s.put("k3test:before", b"x" * 100)
        m.stop(kill=True)
        assert s.exists(["k3test:before"]) == [False]  # a miss, not an exception
        assert s.get("k3test:before") is None
        assert not s.put("k3test:during", b"y")
        assert s.counters.errors >= 2
        m.start()  # same ports; the master starts empty
        deadline = time.time() + 30  # the client re-mounts its segment on its own, within seconds
        while not s.put("k3test:after", b"z" * 100) and time.time() < deadline:
            time.sleep(0.5)
        assert s.get("k3test:after") == b"z" * 100
        assert s.exists(["k3test:before"]) == [False]
    finally:
        s.close()
        m.stop()
