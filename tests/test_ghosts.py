"""Ghosts, miss attribution and the reuse learner (``sglang_k3/cache/ghosts.py``), through the
lifecycle the server and the replay share: what a dropped state leaves behind, how a later
request's unrestored tokens are counted by cause, and when retention keeps a state its placement
rule would drop."""

from __future__ import annotations

import random

from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.ghosts import GhostReason, ReuseLearner, StateClass
from sglang_k3.config import K3Config
from tests.test_lifecycle import IntStore


def _lc(adaptive: bool):
    freed: list[int] = []
    cfg = K3Config(adaptive_retention=adaptive)
    return build_lifecycle(cfg, IntStore(capacity=1000), EvictionPolicy(), freed.extend)


def _request(lc, rid, key, out, slot, chunk=128):
    """One request: match, prefill in chunks of ``chunk`` (a state at each chunk end and at the
    prompt end), then finish after ``out``; returns the match."""
    base = 10_000 * slot
    m = lc.match(rid, key, admit=True, prompt_len=len(key))
    lc.release_pin(rid)
    ends = list(range(m.restore_len + chunk, len(key), chunk)) + [len(key)]
    for end in ends:
        ins = lc.insert(key[:end], range(base, base + end))
        lc.checkpoint_running(rid, ins.node, end, active_slot=slot)
    full = key + out
    ins = lc.insert(full, range(base, base + len(full)))
    lc.finish(ins.node, len(full), len(full), active_slot=slot, rid=rid)
    lc.release(rid)
    return m


def _doc_requests(n_forks: int, seed: int):
    """A long shared prompt, then requests that fork inside it at a chunk boundary or later, as
    questions over the same documents do (the docs family of the suite)."""
    rng = random.Random(seed)
    doc = [rng.randrange(1 << 30) for _ in range(600)]
    first = doc + [1, 2, 3]
    forks = []
    for i in range(n_forks):
        cut = rng.choice((256, 384, 512))
        forks.append(doc[:cut] + [rng.randrange(1 << 30) for _ in range(40 + i)])
    return first, forks


def test_a_recycled_chunk_end_leaves_a_ghost_and_the_fork_that_misses_it_is_counted_by_cause():
    """With the placement rules alone, the first request's chunk ends go (recycled, then one state
    per turn); each leaves a ghost on the KV it sat on. A later request that forks inside that
    prompt restores nothing, and its prompt tokens are counted exactly: the ones below the
    deepest ghost as dropped states, the rest of the shared KV as no state, the rest as no KV."""
    for seed in range(3):
        lc = _lc(adaptive=False)
        first, forks = _doc_requests(1, seed)
        _request(lc, "a", first, [7, 8], slot=1)
        ghosts = {}
        stack = [lc.tree.root]
        while stack:
            n = stack.pop()
            ghosts.update(n.ghosts)
            stack.extend(n.children.values())
        assert sorted(ghosts) == [128, 256, 384, 512, 603]  # chunk ends and the prompt end
        assert {g.reason for g in ghosts.values()} == {GhostReason.DROPPED}
        before = lc.tree.misses.as_dict()
        key = forks[0]
        m = _request(lc, "b", key, [9], slot=2)
        shared = next(i for i, (x, y) in enumerate(zip(key, first)) if x != y)
        deepest = max(p for p in ghosts if p <= shared)
        after = lc.tree.misses.as_dict()
        got = {k: after[k] - before[k] for k in after}
        assert m.restore_len == 0
        assert got == {
            "miss_no_kv_tokens": len(key) - shared,
            "miss_no_state_tokens": shared - deepest,
            "miss_state_dropped_tokens": deepest,
            "miss_state_evicted_tokens": 0,
            "miss_alignment_tokens": 0,
        }, (seed, shared, deepest)
        lc.tree.check_invariants()


def test_an_evicted_state_is_a_ghost_of_its_own_cause_and_a_new_state_replaces_a_ghost():
    lc = _lc(adaptive=True)
    first, _ = _doc_requests(0, 0)
    _request(lc, "a", first, [7, 8], slot=1)
    ck = max(lc.tree.checkpoints(), key=lambda c: c.pos)
    holder = ck.node
    lc.tree.evict_checkpoint(ck)
    assert holder.ghosts[ck.pos].reason is GhostReason.EVICTED
    m = lc.match("b", first + [7, 8, 9], admit=True, prompt_len=len(first) + 3)
    restored = m.restore_len
    assert restored < ck.pos
    assert lc.tree.misses.state_evicted == ck.pos - restored
    lc.release("b")
    # a trim of the KV under a ghost takes the ghost with it
    lc.tree.reset()
    assert not lc.tree.root.ghosts and not lc.tree.root.children


def test_the_learner_keeps_chunk_ends_where_forks_come_back_inside_prompts():
    """The same workload with and without the learner: forks inside a finished prompt restore
    from its chunk ends only when the learner kept them, and every token the rules alone lose
    shows up as a dropped state."""
    for seed in range(3):
        first, forks = _doc_requests(6, seed)
        hits = {}
        for adaptive in (False, True):
            lc = _lc(adaptive)
            _request(lc, "a", first, [7, 8], slot=1)
            got = [_request(lc, f"f{i}", k, [9], slot=2 + i).restore_len for i, k in enumerate(forks)]
            hits[adaptive] = got
            lc.tree.check_invariants()
            if adaptive:
                r = lc.tree.reuse
                assert r.judged[StateClass.CHUNK] >= 1 and r.keeps(StateClass.CHUNK)
            else:
                assert lc.tree.reuse is None
        # the learner's first fork already restores from a kept chunk end; the rules' first misses
        assert hits[True][0] >= 256 and hits[False][0] == 0, hits
        assert sum(hits[True]) > sum(hits[False]), hits


def test_a_class_that_is_never_used_again_stops_being_kept():
    """Linear conversations: each turn extends the last one, so no state inside a finished turn is
    ever restored again. The learner keeps chunk ends only while it has no evidence; once turn
    ends are used and chunk ends are not, the rule drops them again, as without the learner."""
    lc = _lc(adaptive=True)
    rng = random.Random(5)
    kept_late = []
    for conv in range(12):
        key = [rng.randrange(1 << 30) for _ in range(300)]
        for turn in range(4):
            out = [rng.randrange(1 << 30) for _ in range(5)]
            _request(lc, f"c{conv}t{turn}", key, out, slot=1 + conv * 4 + turn)
            key = key + out + [rng.randrange(1 << 30) for _ in range(150)]  # the next turn
        kept_late.append(lc.tree.reuse.keeps(StateClass.CHUNK))
    r = lc.tree.reuse
    assert r.used[StateClass.CHUNK] == 0 and r.judged[StateClass.CHUNK] > 0
    assert not kept_late[-1]


def test_learner_value_is_laplace_around_the_turn_ends():
    r = ReuseLearner()
    assert r.keeps(StateClass.CHUNK)  # no evidence: kept
    for _ in range(4):
        r.observe(StateClass.TURN)
    r.reused(StateClass.TURN, 100.0)  # turn ends save 25 per state
    assert r.value(StateClass.TURN) == 25.0
    assert r.value(StateClass.CHUNK) == 25.0 and r.keeps(StateClass.CHUNK)
    for _ in range(8):
        r.observe(StateClass.CHUNK)
    assert r.value(StateClass.CHUNK) == 50.0 / 10 and not r.keeps(StateClass.CHUNK)
    r.reused(StateClass.CHUNK, 400.0)  # one fork restored far from a chunk end
    assert r.value(StateClass.CHUNK) == 45.0 and r.keeps(StateClass.CHUNK)


def test_a_state_kept_past_its_rule_is_priced_at_what_its_class_has_saved():
    """Until it is hit, a state the learner kept promises its class's saving per state, not the
    whole span it could save (priced by the span, kept states crowded KV out at tight budgets);
    a hit makes it an ordinary state again."""
    lc = _lc(adaptive=True)
    first, forks = _doc_requests(1, 0)
    _request(lc, "a", first, [7, 8], slot=1)
    tree = lc.tree
    kept = [c for c in tree.checkpoints() if c.judged]
    assert kept
    for _ in range(10):
        tree.reuse.observe(StateClass.TURN)
    tree.reuse.reused(StateClass.TURN, 1000.0)  # turn ends: 100 per state
    for ck in kept:
        cls = StateClass.of(ck.kind)
        assert tree.expected_saving(ck) == min(tree.saved_flops(ck), tree.reuse.value(cls))
    ck = max(kept, key=lambda c: c.pos)
    assert tree.expected_saving(ck) < tree.saved_flops(ck)
    m = lc.match("b", first[: ck.pos] + [3], admit=True, prompt_len=ck.pos + 1)
    assert m.restore_len == ck.pos and ck.hits == 1
    assert tree.expected_saving(ck) == tree.saved_flops(ck) * 2  # 1 + log2(1 + 1 hit)
    lc.release("b")
