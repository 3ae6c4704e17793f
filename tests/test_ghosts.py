"""Ghosts, miss attribution and the reuse learner (``sglang_k3/cache/ghosts.py``), through the
lifecycle the server and the replay share: what a dropped state leaves behind, how a later
request's unrestored tokens are counted by cause, and when retention keeps a state its placement
rule would drop."""

from __future__ import annotations

import random

from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.ghosts import EvictedKV, Ghost, GhostReason, MissCounts, ReuseLearner, StateClass
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
            "miss_never_seen_tokens": len(key) - shared,
            "miss_kv_evicted_tokens": 0,
            "miss_no_state_tokens": shared - deepest,
            "miss_state_dropped_tokens": deepest,
            "miss_state_evicted_tokens": 0,
            "miss_tier_missing_tokens": 0,
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


# ------------------------------------------------------------------ evicted KV: "evicted" or "never seen"


def _miss_delta(lc, rid, key):
    """Match ``key`` as an admitted request (then let it go) and return the miss counts it added."""
    before = lc.tree.misses.as_dict()
    m = lc.match(rid, key, admit=True, prompt_len=len(key))
    lc.release(rid)
    after = lc.tree.misses.as_dict()
    got = {k[5:-7]: after[k] - before[k] for k in after}  # miss_<cause>_tokens -> cause
    assert sum(got.values()) == len(key) - m.restore_len  # every token restored or counted once
    return m, got


def test_kv_the_cache_evicted_is_told_apart_from_kv_it_never_held():
    """A request's whole path is evicted (leaf by leaf, each chunk's node in turn). The same
    sequence asked again is counted as evicted KV, to the token; a prompt that shares only its
    first part with it counts that part as evicted and the rest as never seen."""
    for seed in range(3):
        rng = random.Random(seed)
        lc = _lc(adaptive=False)
        first = [rng.randrange(1 << 30) for _ in range(600)]
        _request(lc, "a", first, [7, 8], slot=1)
        lc.tree.evict(num_tokens=10**6)
        assert lc.tree.total_size() == 0
        _, got = _miss_delta(lc, "b", first + [7, 8, 9])
        assert got["kv_evicted"] == 602 and got["never_seen"] == 1, got
        shared = rng.randrange(1, 600)
        _, got = _miss_delta(lc, "c", first[:shared] + [rng.randrange(1 << 30) for _ in range(50)])
        assert got["kv_evicted"] == shared and got["never_seen"] == 50, (seed, shared, got)
        lc.tree.check_invariants()


def test_a_trimmed_tail_is_evicted_kv_and_kv_brought_back_is_no_ghost():
    """KV trimmed past a leaf's last state hangs off that leaf: a prompt that runs on through it
    counts it as evicted. Once that KV is inserted again, the ghost there is gone."""
    rng = random.Random(4)
    lc = _lc(adaptive=False)
    tree = lc.tree
    key = [rng.randrange(1 << 30) for _ in range(300)]
    ins = tree.insert(key, list(range(300)))
    tree.add_checkpoint(ins.node, 128, [1], nbytes=1000, ready=True)
    tree.trim_dead_tail(ins.node)
    assert ins.node.end == 128 and ins.node.gone
    m, got = _miss_delta(lc, "c", key + [9])
    assert m.mla_len == 128 and m.restore_len == 128
    assert got["kv_evicted"] == 300 - 128 and got["never_seen"] == 1, got
    # the KV comes back: no ghost there any more, nothing counted as evicted
    tree.insert(key, list(range(1000, 1300)))
    assert not ins.node.gone
    _, got = _miss_delta(lc, "d", key + [9])
    assert got["kv_evicted"] == 0 and got["never_seen"] == 1 and got["no_state"] == 300 - 128, got
    tree.check_invariants()


def test_with_a_lower_tier_what_the_device_evicted_and_no_tier_gave_back_is_a_tier_miss():
    counts = MissCounts()
    ghost = Ghost(GhostReason.EVICTED)
    counts.record(key_len=100, mla_len=60, cap=60, restore=10, ghost_pos=40, ghost=ghost, evicted_kv=30, tiers=True)
    assert counts.as_dict() == {
        "miss_never_seen_tokens": 10,
        "miss_kv_evicted_tokens": 0,
        "miss_no_state_tokens": 20,
        "miss_state_dropped_tokens": 0,
        "miss_state_evicted_tokens": 0,
        "miss_tier_missing_tokens": 30 + 30,
        "miss_alignment_tokens": 0,
    }
    counts = MissCounts()
    counts.record(key_len=100, mla_len=60, cap=60, restore=10, ghost_pos=40, ghost=ghost, evicted_kv=30)
    assert (counts.kv_evicted, counts.state_evicted, counts.tier_missing, counts.never_seen) == (30, 30, 0, 10)


def test_evicted_kv_ghosts_are_bounded_oldest_first():
    ev = EvictedKV(page_size=1)
    ev.cap = 1000  # as if the tree had held 250 tokens; it only grows with what the tree holds
    owners = []
    for i in range(30):
        owner: dict = {}
        ev.add(owner, [i] * 100, {}, held_tokens=10)
        owners.append(owner)
        assert ev.tokens <= ev.cap
    assert ev.cap == 1000 and ev.tokens == 1000
    assert all(not o for o in owners[:20]) and all(o for o in owners[20:])  # the oldest aged out
    assert ev.run(owners[0], [0] * 100, 0) == 0
    assert ev.run(owners[-1], [29] * 150, 0) == 100
    ev.add({}, [1] * 10, {}, held_tokens=5000)
    assert ev.cap == EvictedKV.HORIZON * 5000


def _remember(seen: set, seq) -> None:
    """Every prefix of ``seq`` (chained hashes): the truth of what the cache was ever given."""
    h = 0
    for t in seq:
        h = hash((h, t))
        seen.add(h)


def _held_before(seen: set, seq) -> int:
    """The longest prefix of ``seq`` the cache was ever given."""
    h, n = 0, 0
    for t in seq:
        h = hash((h, t))
        if h not in seen:
            break
        n += 1
    return n


def test_miss_causes_add_up_and_evicted_kv_is_never_more_than_the_cache_held():
    """Random prompts over shared prefixes in a small budget that evicts after every request.
    Against the truth (every prefix ever inserted), the evicted count never exceeds what the
    cache had held past the KV a match found, and the causes add up to the tokens not restored."""
    for seed in range(4):
        rng = random.Random(seed)
        lc = _lc(adaptive=True)
        heads = [[rng.randrange(1 << 30) for _ in range(rng.randrange(64, 256))] for _ in range(4)]
        seen: set = set()
        history: list = []
        for i in range(40):
            base = rng.choice(heads + history[-5:]) if history else rng.choice(heads)
            fresh = [rng.randrange(1 << 30) for _ in range(rng.randrange(1, 90))]
            key = base[: rng.randrange(1, len(base) + 1)] + fresh
            truth = _held_before(seen, key)
            m, got = _miss_delta(lc, f"probe{i}", key)
            assert got["kv_evicted"] <= max(0, truth - m.mla_len), (seed, i, truth, m.mla_len, got)
            out = [rng.randrange(1 << 30) for _ in range(rng.randrange(1, 20))]
            _request(lc, f"r{i}", key, out, slot=1 + i, chunk=64)
            _remember(seen, key + out)
            history.append(key + out)
            over = lc.tree.total_size() - 700
            if over > 0:
                lc.tree.evict(num_tokens=over)
            lc.tree.check_invariants()
        assert lc.tree.misses.kv_evicted > 0 and lc.tree.misses.never_seen > 0
