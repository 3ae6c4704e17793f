"""The lower tiers' parts, on real tensors: keys, the object format and its validation, the host
store's budget, and the tier manager saving boundaries out of real pools and loading them back
(INT8 checkpoints stay INT8 below the device; a bad object is a miss, never restored)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tier_pools import Pools

from sglang_k3.tiers import codec
from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.keys import BLOCK_TOKENS, Namespace, block_hashes, boundary_key, boundary_keys, kv_block_key
from sglang_k3.tiers.manager import TierManager

NS = Namespace(model="m1", tokenizer="t1", layout="L")
SEED = 1234
B = 64  # the block geometry these tests are written in (the default, 256: test_the_default_block_...)


def test_keys_chain_the_prefix_and_carry_the_namespace():
    rng = random.Random(SEED)
    toks = [rng.randrange(1000) for _ in range(300)]
    h = block_hashes(toks, 300, 64)
    assert len(h) == 4  # whole blocks only
    other = list(toks)
    other[3] += 1  # an early token changes every later block's hash
    h2 = block_hashes(other, 300, 64)
    assert all(a != b for a, b in zip(h, h2))
    assert boundary_key(NS, toks, 200, h, 64) != boundary_key(NS, toks, 201, h, 64)
    assert boundary_key(NS, toks, 200, h, 64) != boundary_key(NS, other, 200, h2, 64)
    window = list(range(255, 191, -1))  # a lookup's positions inside one block, deepest first
    assert boundary_keys(NS, toks, window, h, 64) == [boundary_key(NS, toks, q, h, 64) for q in window]
    for changed in (
        Namespace("m2", "t1", "L"),
        Namespace("m1", "t2", "L"),
        Namespace("m1", "t1", "L2"),
        Namespace("m1", "t1", "L", tp_rank=1, tp_size=2),
    ):
        assert kv_block_key(changed, h[0]) != kv_block_key(NS, h[0])
        assert boundary_key(changed, toks, 200, h, 64) != boundary_key(NS, toks, 200, h, 64)


def test_codec_round_trip_and_every_kind_of_bad_object_is_rejected():
    key = "k"
    blob = codec.encode(key, codec.BOUNDARY, 70, b"S" * 12, b"K" * 24, 6, checkpoint_kind=4)
    obj = codec.decode(key, blob, kv_token_bytes=4, state_bytes=12)
    assert (obj.pos, obj.state, obj.kv, obj.kv_tokens, obj.checkpoint_kind) == (70, b"S" * 12, b"K" * 24, 6, 4)
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    bad = {
        "garbage": bytes(random.Random(SEED).randbytes(len(blob))),
        "truncated": blob[:-5],
        "short": blob[:10],
        "bit flip": bytes(flipped),
    }
    for b in bad.values():
        with pytest.raises(codec.InvalidObject):
            codec.decode(key, b, 4, 12)
    with pytest.raises(codec.InvalidObject, match="another key"):
        codec.decode("other-key", blob, 4, 12)
    with pytest.raises(codec.InvalidObject):
        codec.decode(key, blob, 8, 12)  # another KV layout
    with pytest.raises(codec.InvalidObject):
        codec.decode(key, blob, 4, 16)  # another state size


def test_host_store_budget_lru_and_immutability():
    s = HostStore(100)
    assert s.put("a", b"x" * 40) and s.put("b", b"y" * 40)
    assert s.put("a", b"z" * 40) and s.get("a") == b"x" * 40  # immutable: the first write stays
    assert s.put("c", b"w" * 40)  # evicts b, the least recently used
    assert s.exists(["a", "b", "c"]) == [True, False, True]
    assert s.used_bytes == 80 and s.counters.evictions == 1
    assert not s.put("huge", b"h" * 101) and s.counters.put_refused == 1
    with pytest.raises(ValueError):
        HostStore(0)


def test_host_store_recycles_dropped_buffers_within_its_budget():
    rng = random.Random(SEED)
    s = HostStore(1000)
    sizes = [codec.HEADER_BYTES + k for k in (40, 80, 120)]
    held: dict[str, int] = {}
    for i in range(400):
        op = rng.random()
        if op < 0.6:
            blank = s.blank(0, rng.choice(sizes) - codec.HEADER_BYTES)
            spare_ids = {id(b) for bufs in s._spares.values() for b in bufs}
            assert id(blank.blob) not in spare_ids  # handed out: no longer a spare
            blob = codec.seal(blank, f"k{i}", codec.KV_BLOCK, 0, 0)
            assert s.put(f"k{i}", blob)
            held[f"k{i}"] = id(blob)
        elif op < 0.8 and s._objects:
            s.remove(rng.choice(list(s._objects)))
        elif op < 0.85:
            s.clear()
        # the invariant: objects and spares together never exceed the budget
        assert s.used_bytes + s.spare_bytes <= s.budget_bytes
        assert s.spare_bytes == sum(len(b) for bufs in s._spares.values() for b in bufs)
        live = {id(b) for b in s._objects.values()}
        assert not live & {id(b) for bufs in s._spares.values() for b in bufs}  # no buffer in both
    assert s.counters.recycled > 100
    # a dropped buffer comes back for the next object of its size, and only of its size
    s.clear()
    n = sizes[0] - codec.HEADER_BYTES
    spare = s._spares[sizes[0]][-1]
    assert s.blank(0, n).blob is spare
    assert len(s.blank(0, n + 1).blob) == sizes[0] + 1
    # bytes objects (a Mooncake get) are not recycled: they are immutable
    s.clear()
    assert s.put("b", b"x" * 64) and s.remove("b") and 64 not in s._spares


def _tokens(n: int, seed: int = SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def test_int8_checkpoints_stay_int8_and_round_trip_exactly():
    p = Pools(SEED)
    h = p.checkpoint(1)
    assert p.pool.q.dtype == torch.int8
    assert p.io.state_bytes == p.pool.bytes_per_slot
    data = bytearray(p.io.state_bytes)
    p.io.read_state(h, memoryview(data))
    with pytest.raises(ValueError):
        p.io.read_state(h, memoryview(bytearray(p.io.state_bytes - 1)))
    (h2,) = p.pool.alloc(1)
    assert p.io.write_state(h2, bytes(data))
    assert torch.equal(p.pool.q[h2], p.pool.q[h]) and torch.equal(p.pool.scale[h2], p.pool.scale[h])
    assert torch.equal(p.pool.conv[h2], p.pool.conv[h])
    assert p.pool._sealed[h2]  # read-only like a stored checkpoint
    bad = bytearray(data)
    nq = p.pool.q[0].numel()
    bad[nq : nq + 4] = bytes(torch.tensor([float("nan")]).view(torch.uint8).tolist())  # a scale
    (h3,) = p.pool.alloc(1)
    assert not p.io.write_state(h3, bytes(bad))  # non-finite: refused, as a store refuses one


def _save_path(p: Pools, mgr: TierManager, tokens: list[int], pos: int, active: int) -> list[int]:
    kv = p.fresh_kv(len(tokens))
    mgr.save(tokens, kv, pos, p.checkpoint(active), kind=4)
    return kv


def test_save_then_load_restores_kv_and_state_byte_for_byte():
    p = Pools(SEED)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, p.io, block=B)
    toks = _tokens(300)
    kv = _save_path(p, mgr, toks, 250, active=2)
    assert mgr.counters.saves == 1 and mgr.counters.saved_kv_blocks == 3  # blocks 0-2, tail 192..250
    assert host.held_state_bytes == p.io.state_bytes  # one checkpoint held; the rest is KV and headers
    assert host.used_bytes == p.io.state_bytes + 250 * p.io.kv_token_bytes + 4 * codec.HEADER_BYTES
    request = toks[:280] + _tokens(20, seed=9)
    # the device holds the first 100 tokens' KV and no state
    plan = mgr.find(request, floor=0, cap=len(request) - 1, device_kv=100)
    assert plan is not None and plan.pos == 250 and plan.kv_from == 100
    new_kv = p.fresh_kv(150)
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h) == 4
    for layer in p.kv:
        assert torch.equal(layer[new_kv], layer[kv[100:250]])
    # the state restored is the one saved: compare against a fresh checkpoint of the same slot
    ref = p.checkpoint(2)
    assert torch.equal(p.pool.q[h], p.pool.q[ref]) and torch.equal(p.pool.scale[h], p.pool.scale[ref])
    assert mgr.hits_by_tier["host"] == 1 and mgr.counters.load_kv_tokens == 150


def test_the_default_block_is_a_whole_number_of_pages_and_round_trips():
    """At the default block (256 tokens, a whole number of pages at every page size k3 serves) a
    boundary at 650 tokens is two block objects and a tail of 138 tokens, and it restores byte for
    byte onto a device that holds the first 300 tokens (the load starts inside block 1)."""
    assert BLOCK_TOKENS == 256 and all(BLOCK_TOKENS % page == 0 for page in (1, 16, 32, 64, 128, 256))
    p = Pools(SEED)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, p.io)
    toks = _tokens(700)
    kv = _save_path(p, mgr, toks, 650, active=1)
    assert mgr.counters.saved_kv_blocks == 2 and len(host) == 3
    plan = mgr.find(toks + [7], floor=0, cap=700, device_kv=300)
    assert plan is not None and plan.pos == 650 and plan.kv_from == 300 and len(plan.blocks) == 1
    new_kv = p.fresh_kv(350)
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h) == 4
    assert all(torch.equal(layer[new_kv], layer[kv[300:650]]) for layer in p.kv)
    ref = p.checkpoint(1)
    assert torch.equal(p.pool.q[h], p.pool.q[ref]) and torch.equal(p.pool.scale[h], p.pool.scale[ref])


@pytest.mark.parametrize("write_queue_bytes", [0, 1 << 24])
@pytest.mark.parametrize("read_group_bytes", [1, 16 << 20])
def test_a_batch_of_saves_reads_shared_blocks_once_and_each_boundary_restores(
    write_queue_bytes, read_group_bytes, monkeypatch
):
    """An eviction's demotions go down as one batch (one read off the device): boundaries on one
    path share their blocks, which are read and put once; each boundary then restores byte for
    byte, as it would have after saves one at a time. Read in one group, or one group per boundary
    (each group's read starts while the next is planned)."""
    monkeypatch.setattr(TierManager, "READ_GROUP_BYTES", read_group_bytes)
    p = Pools(SEED, ckpt_slots=16)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, p.io, block=B, write_queue_bytes=write_queue_bytes)
    toks = _tokens(400)
    kv = p.fresh_kv(400)
    other = toks[:100] + _tokens(200, seed=5)  # shares block 0 only
    kv_other = kv[:100] + p.fresh_kv(200)
    batch = [
        (toks, kv, 130, p.checkpoint(0), 4),
        (toks, kv, 390, p.checkpoint(1), 4),
        (other, kv_other, 250, p.checkpoint(2), 4),
    ]
    assert mgr.save_many(batch) == [True, True, True]
    assert mgr.wait_writes()
    # blocks: 0-5 of toks once (the 130-boundary's 0-1 are the 390-boundary's too), 1-2 of other
    assert mgr.counters.saves == 3 and mgr.counters.saved_kv_blocks == 2 + 4 + 2
    assert len(host) == 6 + 2 + 3
    assert mgr.save_many(batch) == [True, True, True] and mgr.counters.save_skips == 3  # held now
    for (t, k, pos, handle, _), seed in zip(batch, (1, 2, 3)):
        q = t[:pos] + _tokens(10, seed=seed)
        plan = mgr.find(q, 0, len(q) - 1, 0)
        assert plan is not None and plan.pos == pos
        new_kv = p.fresh_kv(pos)
        (h,) = p.pool.alloc(1)
        assert mgr.load(plan, new_kv, h) == 4
        assert all(torch.equal(layer[new_kv], layer[k[:pos]]) for layer in p.kv)
        assert torch.equal(p.pool.q[h], p.pool.q[handle]) and torch.equal(p.pool.scale[h], p.pool.scale[handle])


@pytest.mark.parametrize("alloc", ["bytearray", "numpy"])
def test_a_boundary_saved_into_recycled_buffers_restores_byte_for_byte(alloc):
    """Every object of the second save is built in a buffer the first one left (no byte of the
    old objects may survive in the new ones: the IO and the header overwrite all of them). Also
    with numpy buffers, the type the pinned allocator of a CUDA server hands out."""
    p = Pools(SEED)
    host = HostStore(1 << 24, alloc=bytearray if alloc == "bytearray" else lambda n: np.empty(n, dtype=np.uint8))
    mgr = TierManager([host], NS, p.io, block=B)
    first, second = _tokens(300), _tokens(300, seed=SEED + 1)
    _save_path(p, mgr, first, 250, active=1)
    host.clear()
    assert host.spare_bytes == p.io.state_bytes + 250 * p.io.kv_token_bytes + 4 * codec.HEADER_BYTES
    kv = _save_path(p, mgr, second, 250, active=3)
    assert host.counters.recycled == 4 and host.spare_bytes == 0
    plan = mgr.find(second + [1], floor=0, cap=300, device_kv=0)
    assert plan is not None and plan.pos == 250
    new_kv = p.fresh_kv(250)
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h) == 4
    for layer in p.kv:
        assert torch.equal(layer[new_kv], layer[kv[:250]])
    ref = p.checkpoint(3)
    assert torch.equal(p.pool.q[h], p.pool.q[ref]) and torch.equal(p.pool.conv[h], p.pool.conv[ref])
    assert mgr.find(first + [1], floor=0, cap=300, device_kv=0) is None  # the first is gone


def test_find_takes_the_deepest_complete_boundary_and_never_half_of_one():
    p = Pools(SEED, ckpt_slots=16)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, p.io, block=B)
    toks = _tokens(400)
    kv = p.fresh_kv(400)
    for pos in (130, 260, 390):
        mgr.save(toks, kv, pos, p.checkpoint(pos % 4))
    q = toks + [1, 2, 3]
    assert mgr.find(q, 0, len(q) - 1, 0).pos == 390
    assert mgr.find(q, 0, 300, 0).pos == 260  # capped
    assert mgr.find(q, 390, len(q) - 1, 0) is None  # the device already restores there
    # a KV block below 390 vanishes from the tier: 390 is no longer complete, 260 still is
    h = block_hashes(toks, 400, B)
    assert host.remove(kv_block_key(NS, h[4]))  # tokens 256..320
    assert mgr.find(q, 0, len(q) - 1, 0).pos == 260
    # ... unless the device holds that KV itself
    assert mgr.find(q, 0, len(q) - 1, 330).pos == 390


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_model", "state_bit", "kv_block_bit"])
def test_a_bad_object_is_a_counted_miss_and_nothing_is_written(damage):
    """The last two flip one payload bit and leave the header intact: only the checksum the IO
    verifies after the copy up (not the host's header checks) can catch them."""
    p = Pools(SEED)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, p.io, block=B)
    toks = _tokens(200)
    _save_path(p, mgr, toks, 150, active=0)
    key = boundary_key(NS, toks, 150, block_hashes(toks, 150, B), B)
    good = host.get(key)
    host.remove(key)
    if damage == "garbage":
        host.put(key, random.Random(SEED).randbytes(len(good)))
    elif damage == "truncated":
        host.put(key, good[:-100])
    elif damage in ("state_bit", "kv_block_bit"):
        bkey = key if damage == "state_bit" else kv_block_key(NS, block_hashes(toks, 150, B)[1])
        blob = bytearray(good if damage == "state_bit" else host.get(bkey))
        blob[codec.HEADER_BYTES + 7] ^= 0x10
        codec.decode(bkey, bytes(blob), p.io.kv_token_bytes, p.io.state_bytes, verify=False)  # header intact
        host.remove(bkey)
        host.put(bkey, bytes(blob))
        if damage == "kv_block_bit":
            host.put(key, good)
    else:  # a valid object another model wrote, copied under this key
        other = Namespace("another-model", "t1", "L")
        okey = boundary_key(other, toks, 150, block_hashes(toks, 150, B), B)
        obj = codec.decode(key, good, p.io.kv_token_bytes, p.io.state_bytes)
        host.put(key, codec.encode(okey, codec.BOUNDARY, 150, obj.state, obj.kv, obj.kv_tokens))
    q = toks[:160]
    plan = mgr.find(q, 0, len(q) - 1, 0)
    assert plan is not None and plan.pos == 150
    new_kv = p.fresh_kv(150)
    before = [layer[new_kv].clone() for layer in p.kv]
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h) is None
    assert mgr.counters.invalid_objects == 1 and mgr.counters.loads == 0
    assert all(torch.equal(layer[new_kv], b) for layer, b in zip(p.kv, before))
    assert not p.pool._sealed[h]


def test_a_full_tier_refuses_softly():
    p = Pools(SEED)
    host = HostStore(3000)  # smaller than one boundary
    mgr = TierManager([host], NS, p.io, block=B)
    toks = _tokens(200)
    _save_path(p, mgr, toks, 150, active=0)
    assert mgr.counters.save_failures == 1 and mgr.counters.saves == 0
    assert mgr.find(toks, 0, 199, 0) is None


def test_prefetch_copies_a_lower_tiers_boundary_up_to_host_memory():
    """A waiting request's boundary held only by the lower tier is copied into the host tier in the
    background (blocks first, boundary last); the admission then loads it from host memory and the
    prefetch is credited with the time it had."""
    p = Pools(SEED)
    l3 = HostStore(1 << 24, name="l3")
    TierManager([l3], NS, p.io, block=B).save(_tokens(300), p.fresh_kv(300), 250, p.checkpoint(1))
    host = HostStore(1 << 24)
    mgr = TierManager([host, l3], NS, p.io, block=B)
    q = _tokens(300)
    assert mgr.prefetch(q, 0, 299, 0)
    assert mgr.wait_prefetches()
    assert mgr.counters.prefetches == 1 and mgr.counters.prefetch_objects == 4  # 3 blocks + boundary
    assert not mgr.prefetch(q, 0, 299, 0)  # everything is in host memory now: nothing to copy
    plan = mgr.find(q, 0, 299, 0)
    assert plan.store is host and all(store is host for _, _, store in plan.blocks)
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, p.fresh_kv(250), h) is not None
    assert mgr.hits_by_tier == {"host": 1, "l3": 0}
    assert mgr.counters.prefetch_hits == 1 and mgr.counters.prefetch_lead_seconds > 0
    assert not TierManager([l3], NS, p.io, block=B).prefetch(q, 0, 299, 0)  # no host tier above: no prefetch


def _one_request(**k3_flags):
    """The replay's ``k3`` (the server's lifecycle) on the tiny model with a 1 GiB host tier,
    after one 16-symbol prompt with 4 symbols of output ran to its finish."""
    from array import array

    from benchmarks.policies import SimConfig
    from benchmarks.policies.k3 import K3Policy
    from benchmarks.trace.mooncake import SymbolicTrace
    from sglang_k3.cache import preset
    from sglang_k3.config import K3Config

    cfg = SimConfig(cost=preset("tiny"), host_budget_bytes=1 << 30)
    pol = K3Policy(cfg, 1 << 30, K3Config(checkpoint_dtype="int8", **k3_flags))
    seq = array("q", range(1000, 1020))
    trace = SymbolicTrace(64, [0.0], [16 * 64], [4 * 64], [seq], [0], [-1])
    pol.finish(trace, 0, pol.admit(trace, 0).ctx)
    return pol, trace


def test_a_tier_load_never_takes_memory_promised_to_other_requests():
    """SGLang matches the waiting requests one at a time while it fills a prefill batch and
    allocates their KV after; a tier load at a later request's match must fit in what is left
    (``tier_room``), or it is skipped and counted, never taken from the batch (regression: a
    single server with Mooncake died with "Out of memory" at ``alloc_for_extend``)."""
    pol, trace = _one_request(tier_write_policy="write_through")  # its boundaries are written through to host
    lc = pol.lifecycle
    lc.reset()  # the device forgets; the host tier keeps them
    key = trace.prompt(0) + [5555]
    before = pol.tiers.counters.load_no_memory
    m = lc.match("b", key, admit=True, prompt_len=len(key), tier_room=3)
    assert m.restore_len == 0 and pol.tiers.counters.load_no_memory == before + 1
    lc.release_pin("b")
    m = lc.match("b", key, admit=True, prompt_len=len(key), tier_room=None)
    assert m.restore_len >= 16 and pol.tiers.counters.loads >= 1


@pytest.mark.parametrize(
    "policy, at_landing, at_first_hit",
    [("write_back", 0, 0), ("write_through", 1, 0), ("write_through_selective", 0, 1)],
)
def test_write_policies_copy_a_boundary_down_when_their_names_say(policy, at_landing, at_first_hit):
    """SGLang's names: ``write_back`` copies a boundary down only when the device evicts it,
    ``write_through`` as soon as it lands, ``write_through_selective`` at its first hit."""
    pol, trace = _one_request(tier_write_policy=policy)  # no eviction: the budget holds everything
    landed = pol.tiers.counters.saves
    assert (landed > 0) == bool(at_landing), landed
    lc = pol.lifecycle
    lc.match("b", trace.prompt(0) + [5555], admit=True, prompt_len=17)  # the first hit
    lc.release_pin("b")
    assert (pol.tiers.counters.saves > landed) == bool(at_first_hit), pol.tiers.counters.saves


class _GatedHost(HostStore):
    """A real host store whose puts wait until ``gate`` is set: a slow tier (Mooncake over TCP)
    made deterministic, so a test can look while a write is in flight."""

    def __init__(self, budget: int) -> None:
        import threading

        super().__init__(budget)
        self.gate = threading.Event()

    def put(self, key, blob) -> bool:
        assert self.gate.wait(30), "the test never opened the gate"
        return super().put(key, blob)


def test_a_queued_write_is_never_found_before_it_lands_and_the_device_may_change_meanwhile():
    """Writes leave the caller's thread: ``save`` returns while the host tier's put waits. Until
    the boundary object is in the store, ``find`` does not see it (invariant 2, applied to the
    tiers). The save read the bytes off the device before it returned, so the device may free and
    reuse them before the write lands, and what lands is what was saved: boundary B queues behind
    A, whose put holds the one writer thread, and B's device KV is overwritten meanwhile."""
    p = Pools(SEED, ckpt_slots=16)
    host = _GatedHost(1 << 24)
    mgr = TierManager([host], NS, p.io, block=B, write_queue_bytes=1 << 20)
    first, toks = _tokens(200, seed=5), _tokens(300)
    kv_a, kv = p.fresh_kv(200), p.fresh_kv(300)
    saved = [layer[kv[:250]].clone() for layer in p.kv]
    assert mgr.save(first, kv_a, 150, p.checkpoint(1))  # A: its put waits at the gate
    assert mgr.save(toks, kv, 250, p.checkpoint(2), kind=4)  # B: queued behind A
    request = toks[:280] + _tokens(20, seed=9)
    assert mgr.holds(toks, 250)  # in flight: not to be written twice ...
    assert mgr.find(request, floor=0, cap=len(request) - 1, device_kv=0) is None  # ... nor found yet
    assert mgr.save(toks, kv, 250, p.checkpoint(2)) and mgr.counters.save_skips == 1
    for layer in p.kv:
        layer[kv] = 0  # B's device KV is freed and overwritten before its write lands
    host.gate.set()
    assert mgr.wait_writes()
    plan = mgr.find(request, floor=0, cap=len(request) - 1, device_kv=0)
    assert plan is not None and plan.pos == 250
    new_kv = p.fresh_kv(250)
    (h,) = p.pool.alloc(1)
    assert mgr.load(plan, new_kv, h) == 4
    for layer, ref in zip(p.kv, saved):
        assert torch.equal(layer[new_kv], ref)
    c = mgr.counters
    assert (c.writes_queued, c.saves, c.save_dropped) == (2, 2, 0) and c.write_seconds > 0


def test_a_save_never_waits_for_a_full_write_queue_it_is_dropped_and_counted():
    p = Pools(SEED, ckpt_slots=16)
    host = _GatedHost(1 << 24)
    one = 250 * p.io.kv_token_bytes + p.io.state_bytes
    mgr = TierManager([host], NS, p.io, block=B, write_queue_bytes=one + one // 2)  # room for one boundary
    toks = _tokens(600)
    kv = p.fresh_kv(600)
    assert mgr.save(toks, kv, 250, p.checkpoint(1))
    assert not mgr.save(toks[300:], kv[300:], 250, p.checkpoint(2))  # the queue is full: dropped
    assert mgr.counters.save_dropped == 1 and not mgr.holds(toks[300:], 250)
    host.gate.set()
    assert mgr.wait_writes()
    assert mgr.counters.saves == 1 and mgr.holds(toks, 250) and not mgr.holds(toks[300:], 250)
    assert mgr.save(toks[300:], kv[300:], 250, p.checkpoint(2)) and mgr.wait_writes()  # room again
    assert mgr.counters.saves == 2


def test_a_batch_counts_its_own_bytes_against_the_write_queue():
    """Within one ``save_many`` the boundaries planned before count against the queue too: with
    room for one boundary, a batch of three queues the first and drops the other two (each
    counted), and what was dropped can be saved once the queue has drained."""
    p = Pools(SEED, ckpt_slots=16)
    host = _GatedHost(1 << 24)
    one = 250 * p.io.kv_token_bytes + p.io.state_bytes
    mgr = TierManager([host], NS, p.io, block=B, write_queue_bytes=one + one // 2)
    paths = [(_tokens(300, seed=s), p.fresh_kv(300)) for s in (11, 12, 13)]
    batch = [(t, k, 250, p.checkpoint(i), 0) for i, (t, k) in enumerate(paths)]
    assert mgr.save_many(batch) == [True, False, False]
    assert mgr.counters.save_dropped == 2 and mgr.counters.writes_queued == 1
    host.gate.set()
    assert mgr.wait_writes()
    assert [mgr.holds(t, 250) for t, _ in paths] == [True, False, False]
    assert mgr.save_many(batch[1:2]) == [True] and mgr.wait_writes() and mgr.holds(paths[1][0], 250)


class _GatedIO:
    """The real pool IO whose reads land only when the test opens their gate: the link made
    deterministic, so a test can look at the writer between one group's landing and the next's.
    ``fail``: the groups whose copies fail (a broken device): their wait raises."""

    def __init__(self, io, fail=()) -> None:
        import threading

        self.io, self.fail = io, set(fail)
        self.kv_token_bytes, self.state_bytes, self.layout = io.kv_token_bytes, io.state_bytes, io.layout
        self.gates: list = []
        self._event = threading.Event

    def read_payloads(self, parts, outs):
        inner, n, gate = self.io.read_payloads(parts, outs), len(self.gates), self._event()
        failed = n in self.fail

        def wait():
            assert gate.wait(30), "the test never opened the gate"
            if failed:
                raise RuntimeError("the copies failed")
            return inner()

        self.gates.append(gate)
        return wait

    def load_payloads(self, *args):
        return self.io.load_payloads(*args)


def _wait_for(cond, timeout: float = 10.0) -> bool:
    import time

    deadline = time.perf_counter() + timeout
    while not cond() and time.perf_counter() < deadline:
        time.sleep(0.002)
    return cond()


def test_the_writer_puts_each_group_when_it_lands_in_order():
    """A batch goes to the writer group by group: a group is put as soon as it lands while the
    later ones are still in flight (its boundary is found below, theirs are not), and groups are
    put oldest first: a later group that landed waits for an earlier one."""
    p = Pools(SEED, ckpt_slots=16)
    io = _GatedIO(p.io)
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, io, block=B, write_queue_bytes=1 << 24)
    mgr.READ_GROUP_BYTES = 1  # one group per boundary
    paths = [(_tokens(300, seed=s), p.fresh_kv(300)) for s in (21, 22, 23)]
    batch = [(t, k, 250, p.checkpoint(i), 0) for i, (t, k) in enumerate(paths)]
    bkeys = _bkeys(batch)
    assert mgr.save_many(batch) == [True, True, True] and len(io.gates) == 3
    assert [mgr.writer.writing(b) for b in bkeys] == [True, True, True]
    io.gates[2].set()  # the last lands first: not put before the ones handed over earlier
    io.gates[0].set()
    assert _wait_for(lambda: mgr.holds(paths[0][0], 250) and not mgr.writer.writing(bkeys[0]))
    request = paths[0][0][:250] + _tokens(10, seed=9)
    assert mgr.find(request, 0, len(request) - 1, 0).pos == 250
    assert [mgr.writer.writing(b) for b in bkeys[1:]] == [True, True]
    later = paths[2][0][:250] + _tokens(10, seed=9)
    assert mgr.find(later, 0, len(later) - 1, 0) is None  # landed, but behind group 1
    io.gates[1].set()
    assert mgr.wait_writes()
    assert mgr.counters.saves == 3 and all(mgr.holds(t, 250) for t, _ in paths)
    for t, k, pos, _, _ in batch:
        q = t[:pos] + _tokens(10, seed=9)
        plan = mgr.find(q, 0, len(q) - 1, 0)
        new_kv = p.fresh_kv(pos)
        (h,) = p.pool.alloc(1)
        assert mgr.load(plan, new_kv, h) is not None
        assert all(torch.equal(layer[new_kv], layer[k[:pos]]) for layer in p.kv)


def test_a_group_whose_copies_fail_is_counted_and_released_and_the_others_land():
    p = Pools(SEED, ckpt_slots=16)
    io = _GatedIO(p.io, fail={1})
    host = HostStore(1 << 24)
    mgr = TierManager([host], NS, io, block=B, write_queue_bytes=1 << 24)
    mgr.READ_GROUP_BYTES = 1
    paths = [(_tokens(300, seed=s), p.fresh_kv(300)) for s in (31, 32, 33)]
    batch = [(t, k, 250, p.checkpoint(i), 0) for i, (t, k) in enumerate(paths)]
    assert mgr.save_many(batch) == [True, True, True]  # the caller never waits to see it fail
    for g in io.gates:
        g.set()
    assert mgr.wait_writes()
    assert [mgr.holds(t, 250) for t, _ in paths] == [True, False, True]
    assert mgr.counters.saves == 2 and mgr.counters.save_failures == 1
    assert mgr.save_many(batch[1:2]) == [True]  # what failed can be saved again
    io.gates[-1].set()
    assert mgr.wait_writes() and mgr.holds(paths[1][0], 250)


def test_a_lookup_hashes_blocks_in_windows_and_finds_what_a_whole_prompt_lookup_finds():
    """``find`` hashes and asks about the KV blocks past the device's in windows that double while
    every block was found. Differential: over seeded paths whose saved blocks have gaps (objects
    dropped from the host tier) and random device extents, floors and caps, every window size
    gives the plan of a lookup that hashes the whole prompt at once."""
    rng = random.Random(SEED)
    p = Pools(SEED, kv_slots=4096, ckpt_slots=16)
    host = HostStore(1 << 26)
    mgr = TierManager([host], NS, p.io, block=B)
    toks = _tokens(2200, seed=41)
    kv = p.fresh_kv(len(toks))
    for pos in sorted(rng.sample(range(1, 2150), 12)):
        mgr.save(toks, kv, pos, p.checkpoint(rng.randrange(4)), kind=4)
    block_keys = [kv_block_key(NS, h) for h in block_hashes(toks, len(toks), B)]
    for k in rng.sample(range(len(block_keys)), 6):
        host.remove(block_keys[k])  # gaps: a boundary past one is incomplete below

    def plan(window: int, request, floor, cap, device_kv):
        mgr.LOOKUP_BLOCKS = window
        pl = mgr.find(request, floor, cap, device_kv)
        return None if pl is None else (pl.pos, pl.key, pl.kv_from, [(j, k) for j, k, _ in pl.blocks])

    found = 0
    for _ in range(60):
        request = toks[: rng.randrange(2, len(toks))] + _tokens(5, seed=rng.randrange(99))
        cap = rng.randrange(1, len(request))
        device_kv, floor = rng.randrange(0, cap + 1), rng.randrange(0, cap)
        whole = plan(10**9, request, floor, cap, device_kv)
        found += whole is not None
        assert all(plan(w, request, floor, cap, device_kv) == whole for w in (1, 2, 32))
    assert found >= 20  # the differential compares plans, not only misses


def _bkeys(batch) -> list[str]:
    return [boundary_key(NS, t, pos, block_hashes(t, pos, B), B) for t, _, pos, _, _ in batch]


def _two_instances(l3):
    """Two replay instances (the server's lifecycle, tiny model) sharing the lower tier ``l3``:
    ``a`` with no host tier writes its boundaries through to ``l3``; ``b`` has a 1 GiB host tier
    above ``l3``. ``a`` has served one 16-symbol prompt to its finish."""
    from array import array

    from benchmarks.policies import SimConfig
    from benchmarks.policies.k3 import K3Policy
    from benchmarks.trace.mooncake import SymbolicTrace
    from sglang_k3.cache import preset
    from sglang_k3.config import K3Config

    k3 = K3Config(checkpoint_dtype="int8", tier_write_policy="write_through", tier_park_interval=0)
    a = K3Policy(SimConfig(cost=preset("tiny")), 1 << 30, k3, shared_l3=l3)
    b = K3Policy(SimConfig(cost=preset("tiny"), host_budget_bytes=1 << 30), 1 << 30, k3, shared_l3=l3)
    seq = array("q", range(1000, 1020))
    trace = SymbolicTrace(64, [0.0], [16 * 64], [4 * 64], [seq], [0], [-1])
    a.finish(trace, 0, a.admit(trace, 0).ctx)
    return a, b, trace


def _l3(cls=None):
    from benchmarks.policies.tiers import ModelledStore

    return (cls or ModelledStore)(1 << 30, "l3", 1, 1)


def test_a_waiting_request_is_held_until_its_boundary_is_copied_up_from_the_lower_tier():
    """A request whose prefix only the tier below host memory (Mooncake) holds is held back while
    that boundary is copied into the host tier; once the copy lands it is let through, and its
    admission loads from host memory (the scheduler's thread never reads the lower tier). A
    request with nothing below is never held. This is what ``patches/scheduler_hold_tier_loads.py``
    asks at each scheduling call."""
    _, b, trace = _two_instances(_l3())
    lc, tiers = b.lifecycle, b.tiers
    key = trace.prompt(0) + [5555]
    assert lc.held_for_tiers("r", key)  # the copy up started
    assert tiers.counters.prefetches == 1 and lc.bridge.counters.tier_held == 1
    assert tiers.wait_prefetches()
    assert not lc.held_for_tiers("r", key)  # landed: let through
    assert lc.bridge.counters.tier_held_seconds > 0 and lc.bridge.counters.tier_held_expired == 0
    m = lc.match("r", key, admit=True, prompt_len=len(key))
    assert m.restore_len >= 16
    assert tiers.hits_by_tier == {"host": 1, "l3": 0} and tiers.counters.prefetch_hits == 1
    other = [7000 + i for i in range(17)]
    assert not lc.held_for_tiers("s", other) and not lc.held_for_tiers("s", other)
    assert tiers.counters.prefetches == 1 and lc.bridge.counters.tier_held == 1


def _stalled_l3():
    """A lower tier whose reads wait until its ``gate`` is set: one that stopped answering."""
    import threading

    from benchmarks.policies.tiers import ModelledStore

    class Stalled(ModelledStore):
        gate = threading.Event()

        def get(self, key):
            assert self.gate.wait(30), "the test never opened the gate"
            return super().get(key)

    return _l3(Stalled)


def test_a_held_request_is_let_go_when_its_copy_up_hangs():
    """A lower tier that stops answering keeps a request waiting at most ``HOLD_LIMIT_S``; it is
    then admitted without that boundary's copy, and the expiry is counted."""
    import time

    l3 = _stalled_l3()
    _, b, trace = _two_instances(l3)
    lc = b.lifecycle
    lc.bridge.HOLD_LIMIT_S = 0.05
    key = trace.prompt(0) + [5555]
    try:
        assert lc.held_for_tiers("r", key)
        time.sleep(0.1)
        assert not lc.held_for_tiers("r", key)
        assert lc.bridge.counters.tier_held_expired == 1
    finally:
        l3.gate.set()
    assert b.tiers.wait_prefetches()


def test_a_scheduler_with_only_held_requests_waits_for_the_copy_up_not_the_full_timeout():
    """``TierBridge.wait_held`` (what the hold patch calls when the held requests are all the
    scheduler has): while the copy up runs it waits out its bound, and a copy that lands wakes
    it at once, on the copying thread's signal, not at the next poll."""
    import threading
    import time

    l3 = _stalled_l3()
    _, b, trace = _two_instances(l3)
    lc, bridge = b.lifecycle, b.lifecycle.bridge
    key = trace.prompt(0) + [5555]
    try:
        assert lc.held_for_tiers("r", key)
        copying = bridge._holds["r"][0]  # the boundary whose copy up holds it
        assert b.tiers.copy_running(copying)
        t0 = time.perf_counter()
        assert not b.tiers.wait_copy_up(0.05)  # the copy is stuck at the gate: the bound
        assert time.perf_counter() - t0 >= 0.045
        bridge.HOLD_IDLE_WAIT_S = 30.0
        threading.Timer(0.05, l3.gate.set).start()
        t0 = time.perf_counter()
        lc.wait_for_tiers()  # returns when the copy lands, long before 30 s
        assert time.perf_counter() - t0 < 10
        assert bridge.counters.tier_hold_waits == 1
        assert not b.tiers.copy_running(copying)
    finally:
        l3.gate.set()
    assert b.tiers.wait_prefetches()
    assert not lc.held_for_tiers("r", key)  # landed: let through
    assert b.tiers.wait_copy_up(0.0)  # nothing runs: returns at once
