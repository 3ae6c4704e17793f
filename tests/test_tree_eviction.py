"""Eviction order over two resources (KV tokens, checkpoint bytes) and locked-path protection."""

from int_pools import IntPool

from sglang_k3.cache import CheckpointKind, EvictionPolicy, K3RadixTree, preset
from sglang_k3.cache.ranking import Candidate, rank


def build(alpha=1.0, cost=None, page=1):
    tree = K3RadixTree(num_groups=1, page_size=page, hit_unit=64, eviction=EvictionPolicy(cost=cost, alpha=alpha))
    return tree, IntPool(100_000, page), IntPool(1000)


def branch(tree, kv, h, tag, length, ckpts):
    key = [tag] * length
    r = tree.insert(key, kv.alloc(length))
    out = [tree.add_checkpoint(r.node, p, h.alloc(1), nbytes=1000, ready=True) for p in ckpts]
    return key, r.node, out


def test_checkpoint_eviction_is_lru_when_alpha_zero():
    tree, kv, h = build(alpha=0)
    ka, _, [a] = branch(tree, kv, h, 1, 256, [256])
    kb, _, [b] = branch(tree, kv, h, 2, 256, [256])
    tree.match_prefix(ka + [0], pin=False)  # a is now more recent
    freed = tree.evict(num_bytes=1)
    assert freed.handles == b.handles
    assert tree.total_size() == 512  # KV kept: pass-through nodes
    assert tree.stats.evicted_checkpoints == 1


def test_utility_prefers_keeping_checkpoints_that_save_more_flops_per_byte():
    tree, kv, h = build(alpha=10.0, cost=preset("kimi-linear-48b"))
    ka, _, [a_short] = branch(tree, kv, h, 1, 64, [64])
    kb, _, [b_long] = branch(tree, kv, h, 2, 8192, [8192])
    tree.match_prefix(ka + [0], pin=False)  # the cheap one is more recent, but saves little
    freed = tree.evict(num_bytes=1)
    assert freed.handles == a_short.handles


def test_efficiency_is_compared_on_a_log_scale_so_one_outlier_does_not_flatten_the_rest():
    """``outlier`` saves a million times more per byte than ``cheap``, ``mid`` a thousand times
    more, and ``cheap`` is the newest. On a linear scale the outlier sets the range, ``mid`` and
    ``cheap`` both score about 0, and recency alone evicts ``mid`` before ``cheap`` (0.8 < 1). On a
    log scale ``mid`` sits halfway, which outweighs its slightly older access (1.3 > 1)."""

    def order(cands):
        return [c.obj for c in rank(cands, alpha=1.0)]

    cands = [
        Candidate("outlier", last_access=0, saved_flops=1e6, nbytes=1),
        Candidate("mid", last_access=8, saved_flops=1e3, nbytes=1),
        Candidate("cheap", last_access=10, saved_flops=1.0, nbytes=1),
    ]
    got = order(cands)
    assert got.index("cheap") < got.index("mid")
    # a candidate that saves nothing scores below every one that saves something, at equal recency
    nothing = Candidate("nothing", last_access=10, saved_flops=0.0, nbytes=1)
    got = order([*cands, nothing])
    assert got.index("nothing") < got.index("cheap")
    # scale-free: the same ratios in other units rank the same
    assert order([Candidate(c.obj, c.last_access, c.saved_flops * 1e9, c.nbytes * 7) for c in cands]) == order(cands)


def test_a_superseded_state_competes_on_recency_alone():
    """A superseded state (kept only for a regeneration of its prompt) is priced at 0: among
    states of about its age it goes first, but a state that went cold long ago goes before one
    superseded a moment ago, in both the checkpoint pool's eviction and the unified budget's.
    Before, superseded states went strictly first, and a prompt regenerated a few seconds after
    its answer had nearly always lost its state (benchmarks/results/trace_replay_fork_chat)."""
    for evict in (lambda t: t.evict(num_bytes=1), lambda t: t.evict_ranked(need_bytes=1)):
        tree, kv, h = build(cost=preset("kimi-linear-48b"))
        kc, _, [cold] = branch(tree, kv, h, 1, 1024, [1024])  # priced, never used again
        ks, _, [sup] = branch(tree, kv, h, 2, 1024, [1024])  # the same saving, superseded just now
        sup.superseded = True
        tree.match_prefix(ks + [0], pin=False)  # a lookup (not a hit): the mark stays
        freed = evict(tree)
        assert freed.handles == cold.handles and sup.node is not None
        assert sup.superseded and tree.expected_saving(sup) == 0
        # of two states of the same age, the superseded one goes first
        tree2, kv2, h2 = build(cost=preset("kimi-linear-48b"))
        _, _, [a] = branch(tree2, kv2, h2, 1, 1024, [1024])
        _, _, [b] = branch(tree2, kv2, h2, 2, 1024, [1024])
        a.superseded = True
        a.last_access = b.last_access
        assert evict(tree2).handles == a.handles
        # a hit clears the mark: it is priced again
        tree.release_pin(tree.match_prefix(ks + [0], pin=True).pin)
        assert not sup.superseded and tree.expected_saving(sup) > 0


def test_superseded_close_checkpoint_saves_little():
    tree, kv, h = build(alpha=10.0)
    key, node, [c1, c2, c3] = branch(tree, kv, h, 1, 4096, [2048, 2112, 4096])
    # c2 only saves 64 tokens over c1: it goes first even though all have the same recency
    assert tree.evict(num_bytes=1).handles == c2.handles


def test_kv_eviction_takes_dead_tails_first_then_leaves_with_their_checkpoints():
    tree, kv, h = build(alpha=0)
    ka, na, _ = branch(tree, kv, h, 1, 1000, [640])
    kb, nb, [cb] = branch(tree, kv, h, 2, 300, [256])
    freed = tree.evict(num_tokens=300)  # dead tails (past the last checkpoint), LRU: a's 360
    assert len(freed.kv_indices) == 360 and freed.handles == []
    assert len(tree.evict(num_tokens=1).kv_indices) == 44  # then b's tail
    assert tree.match_prefix(ka, pin=False).restore_len == 640  # restores untouched
    freed = tree.evict(num_tokens=1)  # no dead KV left: a whole leaf goes, LRU (b is older)
    assert freed.handles == cb.handles and len(freed.kv_indices) == 256
    assert tree.checkpoint_count() == 1
    tree.check_invariants()


def test_locked_paths_are_never_evicted():
    tree, kv, h = build()
    ka, na, [ca] = branch(tree, kv, h, 1, 512, [512])
    kb, nb, [cb] = branch(tree, kv, h, 2, 512, [512])
    tree.inc_lock_ref(na)
    freed = tree.evict(num_tokens=10_000, num_bytes=10_000)
    assert freed.handles == cb.handles and len(freed.kv_indices) == 512
    assert tree.total_size() == 512 and tree.checkpoint_count() == 1
    tree.dec_lock_ref(na)
    freed = tree.evict(num_tokens=10_000)
    assert freed.handles == ca.handles and tree.total_size() == 0


def test_page_aligned_trim_keeps_the_page_under_a_mid_page_checkpoint():
    tree, kv, h = build(page=256)
    key, node, [c] = branch(tree, kv, h, 1, 1024, [320])
    freed = tree.evict(num_tokens=1)
    assert len(freed.kv_indices) == 1024 - 512  # keeps pages [0,512) covering 320
    assert tree.match_prefix(key, pin=False).restore_len == 320
    tree.check_invariants()


def test_internal_node_becomes_leaf_and_is_evicted_after_children():
    tree, kv, h = build()
    base = list(range(128))
    tree.insert(base + [1] * 128, kv.alloc(256))
    tree.insert(base + [2] * 128, kv.alloc(256))
    freed = tree.evict(num_tokens=10_000)
    assert len(freed.kv_indices) == 384 and not tree.root.children


def test_freed_carries_typed_actions_with_the_reason():
    """What the tree lets go of comes back as actions the caller executes: evicted checkpoints
    (a lower tier could keep those), recycled ones (not worth keeping), KV index runs; the
    totals equal the sum of the actions."""
    from sglang_k3.cache import DropReason, FreeKV, PlacementPolicy, ReleaseCheckpoint

    tree, kv, h = build()
    key, node, [c64, c128] = branch(tree, kv, h, 1, 256, [64, 128])
    c64.kind = CheckpointKind.CHUNK  # superseded by 128 on the same path: recyclable
    rec = tree.recycle_path(node, PlacementPolicy())
    assert rec.actions == [ReleaseCheckpoint(c64.handles, 64, 1000, DropReason.RECYCLED, CheckpointKind.CHUNK)]
    ev = tree.evict(num_tokens=1000)
    kinds = [type(a) for a in ev.actions]
    assert ReleaseCheckpoint in kinds and FreeKV in kinds
    assert [a.reason for a in ev.actions if isinstance(a, ReleaseCheckpoint)] == [DropReason.EVICTED]
    assert sorted(i for a in ev.actions if isinstance(a, FreeKV) for i in a.indices) == sorted(ev.kv_indices)
    assert len(ev.kv_indices) == 256 and ev.handles == c128.handles and tree.total_size() == 0


def test_evicted_boundaries_carry_their_path_for_a_lower_tier_only_when_asked():
    """With ``capture_evicted`` (a lower tier is on) an evicted checkpoint comes back as a
    ``SaveBoundary`` (the tokens and KV indices of its path up to its position, read before the KV
    goes) ahead of its ``ReleaseCheckpoint``; a recycled or superseded one does not (neither is
    worth keeping below), and without the flag no demotion is emitted."""
    from sglang_k3.cache import ReleaseCheckpoint, SaveBoundary

    for capture in (False, True):
        tree, kv, h = build()
        tree.capture_evicted = capture
        key, node, [c64, c128] = branch(tree, kv, h, 1, 256, [64, 128])
        other, _, [d64] = branch(tree, kv, h, 2, 192, [64])
        d64.superseded = True
        ev = tree.evict(num_tokens=10_000)
        rel = {a.pos: a for a in ev.actions if isinstance(a, ReleaseCheckpoint) and a.handles != d64.handles}
        assert sorted(rel) == [64, 128]
        saves = {a.pos: a for a in ev.actions if isinstance(a, SaveBoundary)}
        assert all(a.handle != d64.handles[0] for a in saves.values())  # superseded: not demoted
        if not capture:
            assert saves == {}
            continue
        assert sorted(saves) == [64, 128]
        for pos, a in saves.items():
            assert a.tokens == list(key[:pos]) and len(a.kv) == pos and a.handle == rel[pos].handles[0]
            assert set(a.kv) <= set(ev.kv_indices)  # the same KV the eviction frees
            assert ev.actions.index(a) < ev.actions.index(rel[pos])  # demoted before it is released


# ---------------------------------------------------------------- one budget for both kinds
def test_joint_eviction_takes_a_cold_paths_kv_before_a_hot_checkpoint():
    """KV and checkpoints priced on one scale: the cold path's KV (and its checkpoint) goes, the
    recently hit path's checkpoint stays, even though the request was for bytes of any kind."""
    tree, kv, h = build(alpha=0.3, cost=preset("kimi-linear-48b"))
    cold, _, [c] = branch(tree, kv, h, 1, 512, [512])
    hot, _, [w] = branch(tree, kv, h, 2, 512, [512])
    tree.match_prefix(hot + [0], pin=False)
    freed = tree.evict_ranked(need_bytes=1)
    assert c.handles[0] in freed.handles and w.handles[0] not in freed.handles
    assert w.node is not None and tree.total_size() == 512


def test_joint_eviction_trims_kv_no_restore_can_use_first():
    tree, kv, h = build(alpha=1.0)
    key, node, [ck] = branch(tree, kv, h, 1, 512, [256])
    freed = tree.evict_ranked(need_bytes=1)
    assert len(freed.kv_indices) == 256 and not freed.handles  # the tail past the checkpoint
    assert ck.node is not None


def test_dropping_a_turn_end_counts_and_frees_the_whole_chain_it_kept_alive():
    """A turn's path is a chain of nodes (split where a later prompt and an export matched), and
    its turn-end state is the chain's only one: dropping it frees the whole chain in the same
    call, counted, so an eviction asked for a few tokens takes one turn end, not one per
    chain-end node (the KV only the last node holds)."""
    tree, kv, h = build(alpha=1.0)
    key = [1] * 128 + [2] * 128 + [3] * 128
    for cut in (128, 256, 320, 384):  # each insert adds a node under the last: a chain of four
        tree.insert(key[:cut], kv.alloc(cut))  # the tokens it already holds stay the tree's
    node = tree._walk(key)[0][-1]
    assert node.start == 320 and node.end == 384
    ck = tree.add_checkpoint(node, 384, h.alloc(1), nbytes=1000, ready=True)
    freed = tree.evict_ranked(need_bytes=1)
    assert freed.handles == ck.handles
    assert len(freed.kv_indices) == 384 and tree.total_size() == 0
    tree.check_invariants()


def test_joint_eviction_keeps_the_checkpoint_floor():
    tree, kv, h = build(alpha=1.0)
    branch(tree, kv, h, 1, 256, [256])
    branch(tree, kv, h, 2, 256, [256])
    freed = tree.evict_ranked(need_bytes=10**9, keep_checkpoints=1)
    assert freed.checkpoints == 1 and tree.checkpoint_count() == 1
    tree.check_invariants()


def test_a_state_many_requests_hit_outlives_a_newer_one_that_saves_more_per_hit():
    """A shared system prompt's state saves less per hit than a turn end past it, and it was last
    used before the turn end was placed; but thirty conversations restored from it. Pricing a
    state by the FLOPs it saves times ``1 + log2(1 + hits)`` keeps it; priced by one hit it would
    go right after the coldest state."""
    tree, kv, h = build()
    _, _, [coldest] = branch(tree, kv, h, 9, 128, [128])  # no hits, oldest
    system = [1] * 128
    r = tree.insert(system, kv.alloc(128))
    shared = tree.add_checkpoint(r.node, 128, h.alloc(1), nbytes=1000, ready=True)
    for c in range(30):
        res = tree.match_prefix(system + [100 + c])  # pinned: a restore, counted as a hit
        assert res.restore_len == 128
        tree.release_pin(res.pin)
    turn = system + [2] * 256
    r = tree.insert(turn, tree.path_kv(r.node) + kv.alloc(256))
    newer = tree.add_checkpoint(r.node, 384, h.alloc(1), nbytes=1000, ready=True)
    assert shared.hits == 30 and coldest.last_access < shared.last_access < newer.last_access
    assert tree.saved_flops(newer) > tree.saved_flops(shared)
    freed = tree.evict(num_bytes=1001)  # two checkpoints
    assert freed.handles == coldest.handles + newer.handles
    assert shared.node is not None


def test_evictable_checkpoint_bytes_follow_pins_locks_and_landing():
    """The running tally the unified budget reads (instead of a sum over every checkpoint per call)
    moves with each of the three conditions, with and without path locks protecting states."""
    for protects in (True, False):
        tree = K3RadixTree(num_groups=1, page_size=1, hit_unit=16, lock_protects_checkpoints=protects)
        r = tree.insert(list(range(64)), list(range(64)))
        ck = tree.add_checkpoint(r.node, 32, [1], nbytes=100)  # copy not landed yet
        assert tree.evictable_checkpoint_bytes() == 0
        tree.commit_step()
        assert tree.evictable_checkpoint_bytes() == 100
        m = tree.match_prefix(list(range(40)))  # pinned (and its path locked) for the restore
        assert m.checkpoint is ck and tree.evictable_checkpoint_bytes() == 0
        tree.inc_lock_ref(m.node)  # the request holds its path
        tree.release_pin(m.pin)  # the COW landed
        assert tree.evictable_checkpoint_bytes() == (0 if protects else 100)
        tree.dec_lock_ref(m.node)
        assert tree.evictable_checkpoint_bytes() == 100
        tree.check_invariants()


def test_kv_under_a_checkpoint_that_cannot_go_yet_is_not_counted_as_freeable():
    """SGLang admits a prefill against the evictable size and evicts at allocation: KV held under
    a checkpoint whose copy has not landed (or that is pinned) cannot be freed before then, and
    counting it stopped a server with "Out of memory" (live A/B, gsp under --pressure)."""
    tree, kv, h = build(alpha=0)
    _, na, _ = branch(tree, kv, h, 1, 300, [])
    pending = tree.add_checkpoint(na, 256, h.alloc(1), nbytes=1000, ready=False)
    branch(tree, kv, h, 2, 128, [128])
    assert tree.evictable_size() == 428 and tree.stuck_kv_tokens() == 256
    freed = tree.evict(num_tokens=10_000)  # all that can go: a's 44 past its checkpoint, b's 128
    assert len(freed.kv_indices) == 428 - 256
    assert tree.evictable_size() == tree.stuck_kv_tokens() == 256
    tree.mark_ready(pending)
    assert tree.stuck_kv_tokens() == 0
    assert len(tree.evict(num_tokens=10_000).kv_indices) == 256
    tree.check_invariants()
