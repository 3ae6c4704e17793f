"""The three K3 concurrency invariants; each test fails if its guard is removed."""

import pytest
from int_pools import IntPool

from sglang_k3.cache import CheckpointBusy, K3RadixTree


def tree_with_checkpoint(groups=3, ready=True):
    tree, kv, h = K3RadixTree(num_groups=groups, hit_unit=64), IntPool(10_000), IntPool(100)
    key = list(range(512))
    r = tree.insert(key, kv.alloc(512))
    ck = tree.add_checkpoint(r.node, 512, h.alloc(groups), nbytes=100, ready=ready)
    return tree, kv, h, key, ck


def test_inv1_match_pins_every_group_before_caller_allocates():
    tree, kv, h, key, ck = tree_with_checkpoint()
    m = tree.match_prefix(key + [1])
    assert m.restore_len == 512 and m.pin is not None
    versions = {x: h.version[x] for x in m.handles}
    # the caller now allocates a private slot; the pool is full, so it evicts everything it can
    freed = tree.evict(num_tokens=10_000, num_bytes=10_000)
    assert not set(freed.handles) & set(m.handles) and not freed.kv_indices
    h.free(freed.handles)
    assert all(h.version[x] == versions[x] for x in m.handles)  # the COW source is intact
    tree.release_pin(m.pin)
    freed = tree.evict(num_tokens=10_000, num_bytes=10_000)
    assert sorted(freed.handles) == sorted(m.handles) and len(freed.kv_indices) == 512
    with pytest.raises(ValueError):
        tree.release_pin(m.pin)
    tree.check_invariants()


def test_inv2_checkpoint_registered_this_step_is_not_matchable_until_landed():
    tree, kv, h, key, ck = tree_with_checkpoint(ready=False)
    assert tree.match_prefix(key + [1]).restore_len == 0
    # nor evictable: its slot has a write in flight
    assert tree.evict(num_bytes=10_000).handles == []
    with pytest.raises(CheckpointBusy):
        tree.drop_checkpoint(ck)
    assert tree.commit_step() == 1
    assert tree.match_prefix(key + [1], pin=False).restore_len == 512


def test_inv3_evicting_a_boundary_frees_every_group_atomically():
    tree, kv, h, key, ck = tree_with_checkpoint(groups=4)
    handles = list(ck.handles)
    freed = tree.evict(num_bytes=1)  # one byte's worth takes the whole boundary, all 4 groups
    assert sorted(freed.handles) == sorted(handles)
    assert tree.checkpoint_count() == 0 and tree.checkpoint_bytes() == 0
    assert tree.match_prefix(key + [1]).restore_len == 0
    tree.check_invariants()


def test_inv3_pinned_boundary_cannot_lose_one_group():
    tree, kv, h, key, ck = tree_with_checkpoint()
    m = tree.match_prefix(key + [1])
    with pytest.raises(CheckpointBusy):
        tree.drop_checkpoint(ck)
    assert ck.complete
    tree.release_pin(m.pin)


def test_lock_refs_never_negative():
    tree, kv, h, key, ck = tree_with_checkpoint()
    r = tree.insert(key, tree.path_kv(ck.node))
    tree.inc_lock_ref(r.node)
    assert tree.protected_size() == 512 and tree.evictable_size() == 0
    tree.dec_lock_ref(r.node)
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(r.node)
    assert tree.evictable_size() == 512


@pytest.mark.parametrize("lock_protects", [True, False])
def test_lock_protects_checkpoints_only_when_asked(lock_protects):
    """With ``lock_protects_checkpoints=False`` (the server's setting: requests run on private
    state copies) a lock keeps the KV path but not its checkpoints; pins still protect them."""
    tree = K3RadixTree(num_groups=1, hit_unit=64, lock_protects_checkpoints=lock_protects)
    kv, h = IntPool(1000), IntPool(10)
    key = list(range(128))
    r = tree.insert(key, kv.alloc(128))
    ck = tree.add_checkpoint(r.node, 64, h.alloc(1), nbytes=100, ready=True)
    tree.inc_lock_ref(r.node)
    freed = tree.evict(num_tokens=1000, num_bytes=1000)
    assert not freed.kv_indices  # the locked KV path is never evicted
    assert freed.handles == ([] if lock_protects else ck.handles)
    tree.dec_lock_ref(r.node)
    m = tree.match_prefix(key + [7])
    assert m.restore_len == (64 if lock_protects else 0)
    if m.pin is not None:
        freed = tree.evict(num_bytes=1000)
        assert freed.handles == []  # pinned: the COW source stays
        tree.release_pin(m.pin)
    tree.check_invariants()
