"""The three concurrency invariants with speculative drafts in flight (issue #34), through the
request lifecycle the server runs (``build_lifecycle`` from a default ``K3Config``), with integer
pools that fail on a double free or a write to a freed slot.

A speculative decode step, as SGLang's verify makes it and ``integration/scheduler_verbs.py``
reports it to the cache: the step writes KV for the target's token and its drafts, commits 1 to
``1 + drafts`` of them, and the rejected drafts' KV goes back to the pool. The slot's state then
holds exactly the committed tokens (SGLang's commit of the verify). The cache sees the committed
key only, inside the step's store scope (``process_batch_result``): the decode-interval state is
queued there and lands when the scope ends. Draft KV comes out of the same pool as everything
else, so a verify under a full pool evicts from the tree while other requests hold pins on it.

Invariant 1 (pin before allocating) and 2 (not matchable until the copy has landed) have a test
each that fails without its guard; invariant 3 (a boundary goes whole) is a property over seeded
runs: after every step, every boundary a match can restore has its state slot live with the state
of exactly its tokens, and its KV allocated.
"""

from __future__ import annotations

import random

import pytest
from int_pools import IntPool

from sglang_k3.cache import CheckpointKind as K
from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.config import K3Config

DRAFTS = 3  # a chain of three drafts: four KV positions written per verify


class StateStore:
    """A batching checkpoint store (the int8 store's shape: stores queue until the step's end)
    that records, per checkpoint slot, how many tokens the state it copied had seen."""

    dtype = "int8"
    slot_bytes = 100
    shares_active_slots = False
    batches_stores = True

    def __init__(self, active_len: dict[int, int], capacity: int = 8):
        self.active_len = active_len  # active slot -> tokens its state has seen (the driver's)
        self.capacity = capacity
        self.evict = None  # set by the driver: frees checkpoint bytes through the lifecycle
        self.live: dict[int, int] = {}  # checkpoint slot -> tokens of the state it holds (-1: allocated, no copy yet)
        self._next = 1000

    def alloc(self):
        if len(self.live) >= self.capacity and self.evict is not None:
            self.evict(num_bytes=self.slot_bytes)  # a full pool evicts through the tree, as the server's does
        if len(self.live) >= self.capacity:
            return None
        self._next += 1
        self.live[self._next] = -1
        return self._next

    def capture_active(self, active_slot):
        h = self.alloc()
        if h is not None:
            self.live[h] = self.active_len[active_slot]
        return h

    def donate(self, active_slot):
        return self.capture_active(active_slot)

    def capture_export(self, source, pos):
        h = self.alloc()
        if h is not None:
            self.live[h] = pos
        return h

    def store_many(self, active_slots, handles):
        for a, h in zip(active_slots, handles):
            self.live[h] = self.active_len[a]
        return [True] * len(handles)

    def restore(self, handle, rid, active_slot):
        return None

    def cancel_restore(self, rid):
        pass

    def release_active(self, active_slot):
        pass

    def free(self, handles):
        for h in handles:
            del self.live[h]  # KeyError: a double free

    def stats(self):
        return {"live": len(self.live)}


class Driver:
    """Requests prefilled, then decoded by verify steps, over one KV pool that evicts through the
    lifecycle when short (as SGLang's allocator does through the tree)."""

    def __init__(self, seed: int, kv_size: int = 1200, slots: int = 8, interval: int = 48):
        self.rng = random.Random(seed)
        self.kv = IntPool(kv_size)
        self.active_len: dict[int, int] = {}
        self.store = StateStore(self.active_len, capacity=slots)
        cfg = K3Config(decode_checkpoint_interval=interval, adaptive_retention=False)
        self.lc = build_lifecycle(cfg, self.store, EvictionPolicy(), self.kv.free)
        self.store.evict = self.lc.evict
        self.running: dict[str, dict] = {}

    def alloc_kv(self, n: int) -> list[int]:
        short = n - len(self.kv.free_list)
        if short > 0:
            self.lc.evict(num_tokens=short)
        return self.kv.alloc(n)  # MemoryError if the tree could not free enough

    def _insert(self, r: dict) -> None:
        """Insert the request's key and KV so far (SGLang's ``cache_unfinished_req``): it reads
        the tree's KV back for what the tree holds (indices of its own that the tree did not take
        were freed), and its lock moves to the new node."""
        ins = self.lc.insert(r["key"], r["kv"])
        r["kv"] = self.lc.tree.path_kv(ins.node)[: ins.inserted_len] + r["kv"][ins.inserted_len :]
        self.lc.tree.inc_lock_ref(ins.node)
        if r["node"] is not None:
            self.lc.tree.dec_lock_ref(r["node"])
        r["node"] = ins.node

    def admit(self, rid: str, prompt: list[int], slot: int) -> int:
        """Match (pinning the hit), prefill the rest, checkpoint the prompt end. Returns the hit."""
        m = self.lc.match(rid, prompt, admit=True, prompt_len=len(prompt))
        kv = list(m.kv_indices) + self.alloc_kv(len(prompt) - m.restore_len)  # the hit's KV is the tree's
        self.active_len[slot] = len(prompt)
        r = self.running[rid] = dict(key=list(prompt), kv=kv, node=None, slot=slot)
        self._insert(r)
        self.lc.checkpoint_running(rid, r["node"], len(prompt), active_slot=slot)
        self.lc.release_pin(rid)  # the copy-on-write has landed
        return m.restore_len

    def verify(self, rid: str, accepted: int, scope: bool = True) -> int:
        """One verify step of ``rid``: KV for 1 + DRAFTS positions, ``accepted`` of them committed
        (1 to 1 + DRAFTS), the rest freed; the committed key goes to the cache and, when the step
        crossed the decode interval, its state is queued. Returns the committed length."""
        r = self.running[rid]
        written = self.alloc_kv(1 + DRAFTS)
        for i in written:
            self.kv.write(i)
        self.kv.free(written[accepted:])  # the rejected drafts
        r["key"] += [self.rng.randrange(50_000, 60_000) for _ in range(accepted)]
        r["kv"] += written[:accepted]
        self.active_len[r["slot"]] = len(r["key"])  # SGLang's commit: the state after the accepted tokens
        if scope:
            self.lc.begin_store_scope()
        self._insert(r)
        if self.lc.decode_due(len(r["key"]), accepted):
            self.lc.checkpoint_running(rid, r["node"], len(r["key"]), r["slot"], kind=K.DECODE)
        if scope:
            self.lc.end_store_scope()
        return len(r["key"])

    def finish(self, rid: str) -> None:
        r = self.running.pop(rid)
        self.lc.begin_store_scope()
        self._insert(r)
        self.lc.finish(r["node"], len(r["key"]), self.active_len[r["slot"]], r["slot"], rid=rid)
        self.lc.end_store_scope()
        self.lc.tree.dec_lock_ref(r["node"])
        self.lc.release(rid)

    def check_boundaries(self) -> None:
        """Invariant 3 and the verify's commit: every landed checkpoint (what a match can restore)
        has its slot live with the state of exactly its tokens, and its KV allocated."""
        self.lc.tree.check_invariants()
        for ck in self.lc.tree.checkpoints():
            if not ck.ready:
                continue
            (h,) = ck.handles
            assert self.store.live.get(h) == ck.pos, (ck, self.store.live.get(h))
            kv = self.lc.tree.path_kv(ck.node)[: ck.pos]
            assert len(kv) == ck.pos and all(i in self.kv.allocated for i in kv)


def _prompt(rng, n):
    return [rng.randrange(1, 40_000) for _ in range(n)]


def test_inv1_a_pinned_hit_survives_a_verify_that_needs_draft_kv():
    """B's admitted match pins the boundary A left. Before B's copy lands, A2's verify needs KV for
    its drafts from a pool whose only evictable KV is that hit: the verify finds no room (SGLang
    retracts the request then) and B's source stays whole. Once the pin is released, the same
    verify goes through by evicting it. Without the guard (``match(admit=True)`` pins, eviction
    passes pinned boundaries by) the verify takes B's source."""
    d = Driver(seed=1, kv_size=480)
    rng = random.Random(1)
    d.admit("a", _prompt(rng, 200), slot=1)
    for _ in range(6):
        d.verify("a", accepted=rng.randint(1, 1 + DRAFTS))
    full = list(d.running["a"]["key"])
    d.finish("a")
    m = d.lc.match("b", full + [7], admit=True, prompt_len=len(full) + 1)
    assert m.restore_len == len(full) and m.pin is not None
    (held,) = m.checkpoint.handles
    path = {i: d.kv.version[i] for i in m.kv_indices}
    d.admit("a2", _prompt(rng, len(d.kv.free_list) - DRAFTS), slot=2)  # leaves room for 3 of 4
    with pytest.raises(MemoryError):
        d.verify("a2", accepted=1)
    assert d.store.live.get(held) == len(full)  # B's source state: live, unchanged
    assert all(i in d.kv.allocated and d.kv.version[i] == v for i, v in path.items())  # not reused
    d.check_boundaries()
    d.lc.release_pin("b")
    d.verify("a2", accepted=1)
    assert held not in d.store.live  # unpinned, it could go
    d.check_boundaries()


def test_inv2_a_decode_state_queued_in_a_verify_is_not_matchable_until_it_lands():
    """Inside the verify's store scope, A's decode-interval state is in the tree but not ready:
    another request's match stops below it and eviction under draft-KV pressure cannot take it.
    When the scope ends it restores at exactly A's committed length, holding the state of the
    accepted tokens (not of the drafts)."""
    d = Driver(seed=2, interval=64)
    rng = random.Random(2)
    a = _prompt(rng, 60)
    d.admit("a", a, slot=1)
    d.lc.begin_store_scope()  # the verify that crosses 64
    committed = d.verify("a", accepted=4, scope=False)
    assert committed == 64 and d.lc.decode_due(64, 4)
    key = list(d.running["a"]["key"])
    (ck,) = [c for c in d.lc.tree.checkpoints() if c.pos == committed]
    assert not ck.ready
    assert d.lc.match(None, key + [1], admit=False).restore_len < committed  # not matchable
    d.lc.evict(num_tokens=10_000, num_bytes=10_000)
    assert ck.node is not None and not ck.ready  # not evictable: its copy has not landed
    d.lc.end_store_scope()
    assert ck.ready and d.store.live[ck.handles[0]] == committed
    assert d.lc.match(None, key + [1], admit=False).restore_len == committed
    d.check_boundaries()


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_inv3_every_matchable_boundary_is_whole_under_draft_churn(seed):
    """Seeded mixes of requests that share prompts, verify with random acceptance and finish,
    over pools small enough that draft KV and checkpoints evict each other: after every step each
    restorable boundary is whole (state slot live with its own tokens' state, KV allocated), and a
    request that shares a finished one's prefix restores it."""
    d = Driver(seed=seed, kv_size=900, slots=6, interval=32)
    rng = random.Random(seed)
    systems = [_prompt(rng, rng.randint(40, 120)) for _ in range(3)]
    finished: list[list[int]] = []
    hits = n = 0
    for _ in range(200):
        if len(d.running) < 3:
            n += 1
            if finished and rng.random() < 0.6:  # a next turn of a finished conversation
                prompt = finished.pop(rng.randrange(len(finished))) + _prompt(rng, rng.randint(1, 40))
            else:
                prompt = rng.choice(systems) + _prompt(rng, rng.randint(1, 60))
            hits += d.admit(f"r{n}", prompt, slot=n) > 0
        rid = rng.choice(sorted(d.running))
        d.verify(rid, accepted=rng.randint(1, 1 + DRAFTS))
        if len(d.running[rid]["key"]) > 400 or rng.random() < 0.08:
            finished.append(list(d.running[rid]["key"]))
            d.finish(rid)
        d.check_boundaries()
    stats = d.lc.tree.stats
    print(
        f"seed {seed}: {n} requests, {hits} hits, "
        f"{stats.evicted_checkpoints} states and {stats.evicted_kv_tokens} KV tokens evicted"
    )
    assert hits > 0 and d.lc.tree.checkpoint_count() > 0
    assert stats.evicted_checkpoints > 0 and stats.evicted_kv_tokens > 0  # the pools were short
