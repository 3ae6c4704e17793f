"""Two-phase lookup, fine-grained hits and the upstream failure shapes, over plain ints."""

import pytest
from int_pools import IntPool

from sglang_k3.cache import CheckpointKind, K3RadixTree


def setup(page=1, unit=64, groups=2, kv=100_000):
    return K3RadixTree(num_groups=groups, page_size=page, hit_unit=unit), IntPool(kv, page), IntPool(1000)


def put(tree, kvpool, key):
    """Insert ``key`` with fresh KV; frees what the tree did not take, like the wrapper would."""
    kv = kvpool.alloc(len(key))
    r = tree.insert(key, kv)
    kvpool.free(r.duplicate_kv + kv[r.inserted_len :])
    return r


def ckpt(tree, hpool, node, pos, ready=True, kind=CheckpointKind.CHUNK):
    return tree.add_checkpoint(node, pos, hpool.alloc(tree.num_groups), nbytes=10, kind=kind, ready=ready)


def test_two_phase_restore_at_nearest_ready_checkpoint_below_mla_hit():
    tree, kv, h = setup()
    key = list(range(3000))
    r = put(tree, kv, key)
    for pos in (640, 2560):
        ckpt(tree, h, r.node, pos)
    m = tree.match_prefix(key[:2800] + [-1] * 100)
    assert (m.mla_len, m.restore_len, m.replayed_tokens) == (2800, 2560, 240)
    assert m.kv_indices == tree.path_kv(r.node)[:2560]
    assert m.handles == m.checkpoint.handles and len(m.handles) == 2


def test_hit_inside_a_large_page_lands_on_hit_unit_multiple():
    tree, kv, h = setup(page=1024)
    key = list(range(4096))
    r = put(tree, kv, key)
    ckpt(tree, h, r.node, 2560)  # inside the page [2048, 3072)
    m = tree.match_prefix(key[:2800] + [-5] * 10)
    assert (m.mla_len, m.restore_len) == (2800, 2560)
    assert len(m.kv_indices) == 2560 and m.kv_cow_tokens == 2560 % 1024


def test_divergence_inside_a_page_matches_token_granular_and_splits_on_pages():
    tree, kv, h = setup(page=16, unit=16)
    a = list(range(64))
    b = a[:40] + [999] * 24
    ra = put(tree, kv, a)
    ckpt(tree, h, ra.node, 32)
    rb = put(tree, kv, b)
    assert rb.prefix_len == 32  # shared whole pages only
    m = tree.match_prefix(b + [1])
    assert m.restore_len == 32 and m.mla_len == 64
    m2 = tree.match_prefix(a[:40] + [7, 7])
    assert m2.mla_len == 40  # token-granular inside the diverging page
    tree.check_invariants()


def test_fully_contained_prompt_still_hits_and_leaves_one_token():
    tree, kv, h = setup()
    key = list(range(256))
    r = put(tree, kv, key)
    for pos in (64, 128, 192, 256):
        ckpt(tree, h, r.node, pos)
    m = tree.match_prefix(key)
    assert m.mla_len == 256 and m.restore_len == 192  # cap 255 -> nearest checkpoint 192
    m = tree.match_prefix(key[:129])
    assert m.restore_len == 128


def test_boundary_missing_one_group_is_never_used():
    tree, kv, h = setup(groups=3)
    key = list(range(300))
    r = put(tree, kv, key)
    ckpt(tree, h, r.node, 64)
    partial = tree.add_checkpoint(r.node, 256, [h.alloc(1)[0], None, h.alloc(1)[0]], 10, ready=True)
    assert tree.match_prefix(key).restore_len == 64
    tree.attach_group_handle(partial, 1, h.alloc(1)[0])
    assert tree.match_prefix(key).restore_len == 256


def test_unwritten_checkpoint_is_never_restored():
    tree, kv, h = setup()
    key = list(range(300))
    r = put(tree, kv, key)
    ck = ckpt(tree, h, r.node, 256, ready=False)
    assert tree.match_prefix(key).restore_len == 0
    tree.mark_ready(ck)
    assert tree.match_prefix(key).restore_len == 256


def test_key_ending_inside_a_page_makes_no_empty_node_and_evicts_cleanly():
    tree, kv, h = setup(page=64)
    r = put(tree, kv, list(range(30)))  # shorter than a page: nothing inserted
    assert r.inserted_len == 0 and r.node is tree.root and not tree.root.children
    r = put(tree, kv, list(range(100)))  # 1.56 pages: one page kept
    assert r.inserted_len == 64 and tree.total_size() == 64
    r2 = put(tree, kv, list(range(64)) + [5] * 70)
    assert r2.inserted_len == 128
    tree.check_invariants()
    freed = tree.evict(num_tokens=10_000)
    kv.free(freed.kv_indices)
    assert tree.total_size() == 0 and kv.used == 0
    tree.check_invariants()


def test_duplicates_returned_and_tree_indices_kept():
    tree, kv, _ = setup()
    key = list(range(100))
    first = kv.alloc(100)
    tree.insert(key, first)
    again = kv.alloc(100)
    r = tree.insert(key + [1, 2], again + kv.alloc(2))
    assert r.prefix_len == 100 and r.duplicate_kv == again
    # reinserting with the tree's own indices is not a duplicate
    assert tree.insert(key, first).duplicate_kv == []


def test_add_checkpoint_validates_position_and_duplicates():
    tree, kv, h = setup()
    r = put(tree, kv, list(range(200)))
    with pytest.raises(ValueError):
        ckpt(tree, h, r.node, 100)  # not a hit-unit multiple
    with pytest.raises(ValueError):
        ckpt(tree, h, r.node, 256)  # beyond the KV
    assert ckpt(tree, h, r.node, 128) is not None
    assert ckpt(tree, h, r.node, 128) is None  # caller keeps its handles


def test_find_branch_point():
    tree, kv, _ = setup()
    base = list(range(1000))
    put(tree, kv, base)
    assert tree.find_branch_point(base + [1] * 10) is None  # extension of a leaf
    assert tree.find_branch_point(base[:700] + [-1] * 50) == 640
    assert tree.find_branch_point(base[:500]) is None  # contained


def test_stats_track_hit_rate_and_replay():
    tree, kv, h = setup()
    key = list(range(1000))
    r = put(tree, kv, key)
    ckpt(tree, h, r.node, 896)
    tree.match_prefix(key + [1])
    tree.match_prefix([-1] * 1001)
    s = tree.stats
    assert s.lookups == 2 and s.hit_tokens == 896 and s.replayed_tokens == 104
    assert s.token_hit_rate == pytest.approx(896 / 2002)
    assert s.checkpoints == 1 and s.checkpoint_bytes == 10


def test_touch_refreshes_what_a_match_would_restore_without_pinning_or_counting():
    tree = K3RadixTree(num_groups=1, hit_unit=1)
    a, b = list(range(100)), [7] + list(range(1, 100))
    na = tree.insert(a, list(range(100))).node
    nb = tree.insert(b, list(range(100, 200))).node
    ca = tree.add_checkpoint(na, 100, [1], 10, kind=CheckpointKind.GEN_END, ready=True)
    cb = tree.add_checkpoint(nb, 100, [2], 10, kind=CheckpointKind.GEN_END, ready=True)
    lookups = tree.stats.as_dict()
    assert ca.last_access < cb.last_access
    assert tree.touch(a + [5]) == 100
    assert ca.last_access > cb.last_access and na.last_access > nb.last_access
    after = tree.stats.as_dict()
    assert after.pop("waiting_refreshes") == lookups.pop("waiting_refreshes") + 1  # a refresh, not a lookup
    assert ca.pins == 0 and ca.hits == 0 and after == lookups
    tree.check_invariants()
