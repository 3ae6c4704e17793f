"""The request lifecycle the server's cache and the replay share (``sglang_k3/cache/lifecycle.py``),
driven directly with int handles: what each verb puts in the tree, who owns a slot after
``finish``, the per-step store queue, and what a re-match or an abort releases."""

from __future__ import annotations

from typing import Optional

import pytest

from sglang_k3.cache import CheckpointKind as K
from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.build import build_lifecycle, placement_from_config
from sglang_k3.config import K3Config


class IntStore:
    """A checkpoint store over plain ints that records what the lifecycle asked of it (the pool is
    real in the server tests; here the lifecycle is what is tested). ``shares`` models the fp32
    store (donation takes the active slot), ``refuse`` makes ``store_many`` refuse handles."""

    dtype = "int8"
    slot_bytes = 100

    def __init__(self, capacity: int = 100, shares: bool = False, batches: bool = False):
        self.capacity = capacity
        self.shares_active_slots = shares
        self.batches_stores = batches
        self.live: set[int] = set()
        self.released_active: list[int] = []
        self.cancelled: list[str] = []
        self.refuse: set[int] = set()
        self._next = 1000

    def alloc(self) -> Optional[int]:
        if len(self.live) >= self.capacity:
            return None
        self._next += 1
        self.live.add(self._next)
        return self._next

    def capture_active(self, active_slot):
        return self.alloc()

    def donate(self, active_slot):
        if self.shares_active_slots:
            self.live.add(active_slot)
            return active_slot
        return self.alloc()

    def capture_export(self, source, pos):
        return self.alloc()

    def store_many(self, active_slots, handles):
        ok = [h not in self.refuse for h in handles]
        for h, good in zip(handles, ok):
            if not good:
                self.live.remove(h)  # a refused store releases its handle
        return ok

    def restore(self, handle, rid, active_slot):
        return None

    def cancel_restore(self, rid):
        self.cancelled.append(rid)

    def release_active(self, active_slot):
        self.released_active.append(active_slot)

    def free(self, handles):
        for h in handles:
            self.live.remove(h)

    def stats(self):
        return {"live": len(self.live)}


def _lc(store=None, **cfg):
    store = store or IntStore()
    freed_kv: list[int] = []
    # The placement rules themselves; where the reuse learner keeps a state a rule would drop is
    # tested in test_ghosts.py.
    cfg.setdefault("adaptive_retention", False)
    lc = build_lifecycle(K3Config(**cfg), store, EvictionPolicy(), freed_kv.extend)
    return lc, store, freed_kv


def _positions(lc, node):
    return [(c.pos, c.kind) for c in lc.tree.path_checkpoints(node)]


def test_running_checkpoints_then_finish_donates_to_a_sharing_store():
    lc, store, _ = _lc(IntStore(shares=True))
    key = list(range(300))
    m = lc.match("r", key, admit=True, prompt_len=300)
    assert m.restore_len == 0 and lc.requests["r"].prompt_len == 300
    ins = lc.insert(key[:128], range(128))
    lc.checkpoint_running("r", ins.node, 128, active_slot=7)
    ins = lc.insert(key, range(300))
    lc.checkpoint_running("r", ins.node, 300, active_slot=7)
    # the chunk checkpoint at 128 is superseded by the prompt end: recycled
    assert _positions(lc, ins.node) == [(300, K.PROMPT_END)]
    full = key + [900, 901]
    ins = lc.insert(full, range(302))
    lc.finish(ins.node, 302, 302, active_slot=7)
    assert 7 in store.live and store.released_active == []  # donated: the tree owns slot 7
    assert [p for p, _ in _positions(lc, ins.node)] == [300, 302]
    lc.release("r")
    assert lc.requests == {}
    assert lc.match(None, full + [5], admit=False).restore_len == 302
    lc.tree.check_invariants()


def test_finish_releases_the_slot_when_the_state_is_not_at_the_key_end():
    lc, store, _ = _lc(IntStore(shares=True))
    key = list(range(100))
    lc.match("r", key, admit=True, prompt_len=100)
    ins = lc.insert(key, range(100))
    lc.finish(ins.node, 100, 101, active_slot=3)  # the slot is one token further: not this key's
    assert store.released_active == [3] and 3 not in store.live
    assert lc.tree.checkpoint_count() == 0


def test_finish_with_a_copying_store_releases_the_active_slot():
    lc, store, _ = _lc(IntStore(shares=False))
    key = list(range(100))
    lc.match("r", key, admit=True, prompt_len=100)
    ins = lc.insert(key, range(100))
    lc.finish(ins.node, 100, 100, active_slot=3)
    assert store.released_active == [3] and lc.tree.checkpoint_count() == 1


def test_a_rematch_replaces_the_pin_and_release_cancels_the_restore():
    lc, store, _ = _lc()
    key = list(range(200))
    lc.match("a", key, admit=True, prompt_len=200)
    ins = lc.insert(key, range(200))
    lc.checkpoint_running("a", ins.node, 200, active_slot=1)
    lc.release("a")
    m1 = lc.match("b", key + [1], admit=True, prompt_len=201)
    assert m1.restore_len == 200 and m1.checkpoint.pins == 1
    m2 = lc.match("b", key + [1], admit=True, prompt_len=201)  # waiting, matched again
    assert m2.checkpoint is m1.checkpoint and m1.checkpoint.pins == 1 and m1.pin.released
    lc.release("b")
    assert m1.checkpoint.pins == 0 and "b" in store.cancelled
    lc.tree.check_invariants()


def test_done_requests_are_forgotten_and_their_pins_released():
    lc, store, _ = _lc()
    key = list(range(200))
    lc.match("a", key, admit=True, prompt_len=200)
    lc.checkpoint_running("a", lc.insert(key, range(200)).node, 200, active_slot=1)
    lc.release("a")
    done = {"b": False}
    m = lc.match("b", key + [2], admit=True, prompt_len=201, is_done=lambda: done["b"])
    assert m.checkpoint.pins == 1
    assert lc.forget_done() == 0 and "b" in lc.requests
    done["b"] = True  # e.g. aborted while waiting
    assert lc.forget_done() == 1 and lc.requests == {} and m.checkpoint.pins == 0


def test_queued_stores_land_at_the_end_of_the_step_and_refusals_leave_the_tree():
    lc, store, _ = _lc(IntStore(batches=True))
    a, b = list(range(200)), list(range(1000, 1200))
    lc.begin_store_scope()
    lc.match("a", a, admit=True, prompt_len=200)
    lc.match("b", b, admit=True, prompt_len=200)
    na, nb = lc.insert(a, range(200)).node, lc.insert(b, range(200, 400)).node
    lc.checkpoint_running("a", na, 200, active_slot=1)
    lc.finish(nb, 200, 200, active_slot=2)
    # in the tree, not ready: not matchable, not evictable; b's active slot held for its store
    assert lc.tree.checkpoint_count() == 2 and lc.match(None, a + [0], admit=False).restore_len == 0
    assert store.released_active == []
    store.refuse.add(lc.tree.path_checkpoints(nb)[0].handles[0])
    lc.end_store_scope()
    assert lc.counters.store_flushes == 1 and lc.counters.stores_flushed == 1
    assert lc.match(None, a + [0], admit=False).restore_len == 200
    assert lc.match(None, b + [0], admit=False).restore_len == 0  # refused: gone from the tree
    assert store.released_active == [2]
    lc.tree.check_invariants()


def test_a_full_store_evicts_through_the_tree_and_skips_when_it_cannot():
    lc, store, _ = _lc(IntStore(capacity=1))
    a = list(range(100))
    lc.match("a", a, admit=True, prompt_len=100)
    na = lc.insert(a, range(100)).node
    lc.checkpoint_running("a", na, 100, active_slot=1)
    assert lc.tree.checkpoint_count() == 1
    b = list(range(500, 600))
    lc.match("b", b, admit=True, prompt_len=100)
    nb = lc.insert(b, range(100, 200)).node
    lc.checkpoint_running("b", nb, 100, active_slot=2)  # the store is full: nothing placed
    assert lc.tree.checkpoint_count() == 1
    freed = lc.evict(num_bytes=1)
    assert freed.checkpoints == 1 and store.live == set()
    lc.checkpoint_running("b", nb, 100, active_slot=2)
    assert lc.tree.checkpoint_count() == 1 and lc.match(None, b + [1], admit=False).restore_len == 100


def test_export_plan_and_store_exports_follow_the_placement():
    lc, store, _ = _lc()
    key = list(range(300))
    lc.match("a", key, admit=True, prompt_len=300)

    class Source:
        def grid(self):
            return [64, 128, 192, 256]

        def kept(self, pos):
            return pos in planned

    planned = set(lc.export_plan("a", Source().grid(), 300))
    assert planned == {256}  # the prompt end is reached: its last grid point; no branch point
    node = lc.insert(key, range(300)).node
    lc.store_exports("a", node, 300, Source())
    assert _positions(lc, node) == [(256, K.PROMPT_END)]


def test_placement_from_config_scales_only_the_units():
    cfg = K3Config()
    tok, sym = placement_from_config(cfg, 1), placement_from_config(cfg, 64)
    assert tok.hit_unit == sym.hit_unit == 1
    assert tok.decode_interval == 4096 and sym.decode_interval == 64
    assert tok.per_path_budget == sym.per_path_budget == cfg.checkpoint_budget
    off = placement_from_config(K3Config(decode_checkpoint_interval=0, checkpoint_budget=0), 64)
    assert off.decode_interval is None and off.per_path_budget is None
    with pytest.raises(ValueError):
        K3Config(checkpoint_dtype="fp16")


def _turn(lc, rid, key, out, slot):
    """One request: match, one prefill chunk to the prompt end, then finish after ``out``."""
    base = 10_000 * slot  # the request's own KV indices (the tree frees those it already holds)
    lc.match(rid, key, admit=True, prompt_len=len(key))
    ins = lc.insert(key, range(base, base + len(key)))
    lc.checkpoint_running(rid, ins.node, len(key), active_slot=slot)
    lc.release_pin(rid)
    full = key + out
    ins = lc.insert(full, range(base, base + len(full)))
    lc.finish(ins.node, len(full), len(full), active_slot=slot, rid=rid)
    lc.release(rid)
    return ins.node


def test_one_state_per_turn_the_generation_end_supersedes_the_prompt_end():
    """The next turn matches the generation end; the request's own prompt-end state leaves the
    tree when the generation-end state lands (and stays with --k3-keep-superseded-checkpoints)."""
    for keep in (False, True):
        lc, store, _ = _lc(checkpoint_keep_superseded=keep)
        key = list(range(300))
        node = _turn(lc, "a", key, [900, 901], slot=1)
        assert [p for p, _ in _positions(lc, node)] == ([300, 302] if keep else [302])
        assert len(store.live) == (2 if keep else 1) and lc.tree.stats.recycled_checkpoints == (0 if keep else 1)
        nxt = key + [900, 901, 5, 6]
        assert lc.match(None, nxt, admit=False).restore_len == 302  # the next turn still hits in full
        lc.tree.check_invariants()


def test_one_state_per_turn_keeps_states_with_evidence_of_forks():
    lc, store, _ = _lc()
    key = list(range(300))
    # a repeated prompt (a regeneration): its prompt-end state stays for the next regeneration
    _turn(lc, "a", key, [900, 901], slot=1)
    node = _turn(lc, "b", key, [700, 701], slot=2)
    assert lc.match(None, key, admit=False).mla_len == 300
    assert sorted(p for p, _ in _positions(lc, node)) == [300, 302]
    # a state that was hit stays: a later request restored from b's prompt end and went elsewhere
    lc.match("c", key + [1], admit=True, prompt_len=301)
    lc.release("c")
    ck300 = next(c for c in lc.tree.path_checkpoints(node) if c.pos == 300)
    assert ck300.hits == 1
    # the restored-from state of a continuation goes when the continuation's own turn end lands,
    # unless someone else hit it too
    nxt = key + [700, 701, 5, 6]
    turn2 = _turn(lc, "d", nxt, [8], slot=3)
    positions = [p for p, _ in _positions(lc, turn2)]
    assert 302 not in positions and 300 in positions and 305 in positions
    lc.tree.check_invariants()


def test_the_repeat_state_stays_superseded_and_is_priced_at_nothing():
    """The state a repeat of the prompt restores from (the deepest one inside the prompt) stays
    when the generation end supersedes the turn, marked superseded: a repeat still hits it, and
    under pressure it is priced at 0, so of states of its age it goes first (it competes on
    recency alone: tests/test_tree_eviction.py); a hit clears the mark."""
    lc, store, _ = _lc()
    key = list(range(300))
    lc.match("a", key, admit=True, prompt_len=300)
    ins = lc.insert(key, range(300))
    lc.checkpoint_running("a", ins.node, 256, active_slot=1, kind=K.PROMPT_END)  # the exported grid point
    lc.checkpoint_running("a", ins.node, 300, active_slot=1)
    full = key + [900, 901]
    ins = lc.insert(full, range(302))
    lc.finish(ins.node, 302, 302, active_slot=1, rid="a")
    lc.release("a")
    cks = {c.pos: c for c in lc.tree.path_checkpoints(ins.node)}
    assert sorted(cks) == [256, 302] and cks[256].superseded and not cks[302].superseded
    assert lc.tree.expected_saving(cks[256]) == 0 < lc.tree.expected_saving(cks[302])
    lc.evict_until(lambda: lc.tree.checkpoint_count() < 2, step_bytes=1)
    assert [c.pos for c in lc.tree.checkpoints()] == [302]  # the superseded one went first
    # a hit clears the mark
    lc2, _, _ = _lc()
    lc2.match("a", key, admit=True, prompt_len=300)
    n = lc2.insert(key, range(300)).node
    lc2.checkpoint_running("a", n, 256, active_slot=1, kind=K.PROMPT_END)
    lc2.finish(lc2.insert(full, range(302)).node, 302, 302, active_slot=1, rid="a")
    lc2.release("a")
    assert lc2.match(None, key, admit=False).restore_len == 256  # a repeat of the prompt still hits
    lc2.match("b", key, admit=True, prompt_len=300)
    assert not next(c for c in lc2.tree.checkpoints() if c.pos == 256).superseded
    lc2.release("b")
    lc2.tree.check_invariants()


def test_eviction_alpha_comes_from_the_config():
    lc, _, _ = _lc(eviction_alpha=0.0)
    assert lc.tree.policy.alpha == 0.0
    assert _lc()[0].tree.policy.alpha == 1.0
    with pytest.raises(ValueError, match="eviction_alpha"):
        K3Config(eviction_alpha=-1.0)


class _Grid:
    """An extend's exports as the server's stash has them: the 64-token grid past its start."""

    def __init__(self, start: int, end: int, kept=()):
        self.start, self.end, self._kept = start, end, set(kept)

    def grid(self):
        return list(range(self.start + 64, self.end, 64))

    def kept(self, pos):
        return pos in self._kept


def test_the_state_below_a_fork_outlives_the_turns_that_fork_there():
    """Requests that continue one prompt differently restore from the last state before the fork
    (here the prompt's 64-token grid point). When the fork lies less than one grid step above it,
    the forking request's extend exports nothing nearer: the state it restored from is the branch
    state, and its own turn end must not drop it as superseded, or the next fork restores
    nothing (seen live: 0 cached tokens on every other fork)."""
    lc, _, _ = _lc()
    prompt = list(range(200))
    lc.match("a", prompt, admit=True, prompt_len=200)
    node = lc.insert(prompt, range(200)).node
    lc.checkpoint_running("a", node, 192, active_slot=1, kind=K.PROMPT_END)  # the exported grid point
    lc.checkpoint_running("a", node, 200, active_slot=1)
    full = prompt + [900, 901, 902]
    lc.finish(lc.insert(full, range(203)).node, 203, 203, active_slot=1, rid="a")
    lc.release("a")
    for i, rid in enumerate(["b", "c", "d"]):
        key = prompt + [500 + 100 * i + j for j in range(70)]  # its own grid point at 256
        m = lc.match(rid, key, admit=True, prompt_len=len(key))
        assert m.restore_len == 192, (rid, m.restore_len)
        assert lc.requests[rid].branch_point == 200
        ins = lc.insert(key, range(1000 * (i + 2), 1000 * (i + 2) + len(key)))
        lc.store_exports(rid, ins.node, len(key), _Grid(192, len(key), kept=[256]))
        assert lc.has_checkpoint_at(ins.node, 256)
        lc.release_pin(rid)
        out = key + [7, 8]
        lc.finish(lc.insert(out, range(1000 * (i + 2), 1000 * (i + 2) + len(out))).node, len(out), len(out), 5, rid=rid)
        lc.release(rid)
    ck = next(c for c in lc.tree.checkpoints() if c.pos == 192)
    assert ck.kind & K.BRANCH and ck.hits == 3 and not ck.superseded
    lc.tree.check_invariants()


def test_requests_admitted_together_find_their_fork_when_their_forward_is_planned():
    """Two prompts sharing a 128-token prefix are admitted before either has a path in the tree
    (one batch, or the overlap scheduler admitting the second before the first prefill's results
    are processed): at match neither sees a fork. When the second one's forward is planned the
    first one's path is in, so it keeps the state at the shared prefix for the next sharer."""
    lc, _, _ = _lc()
    shared = list(range(128))
    a, b = shared + list(range(1000, 1100)), shared + list(range(2000, 2100))
    lc.match("a", a, admit=True, prompt_len=len(a))
    lc.match("b", b, admit=True, prompt_len=len(b))
    assert lc.requests["b"].branch_point is None  # the tree was empty
    lc.export_plan("a", _Grid(0, len(a)).grid(), len(a))
    lc.insert(a, range(len(a)))
    plan = lc.export_plan("b", _Grid(0, len(b)).grid(), len(b))
    assert lc.requests["b"].branch_point == 128 and 128 in plan
    ins = lc.insert(b, range(5000, 5000 + len(b)))
    lc.store_exports("b", ins.node, len(b), _Grid(0, len(b), kept=plan))
    c = shared + list(range(3000, 3050))
    assert lc.match(None, c, admit=False).restore_len == 128
    lc.tree.check_invariants()
