"""Ragged leaves: with KV pages over one token, a finished request keeps its last, partial page
and the exact state at its end; a later request restores inside that page and goes on in a page
of its own, and the ragged leaf's state moves to the node holding that page."""

from int_pools import IntPool, PagedPool

from sglang_k3.cache import CheckpointKind, K3RadixTree

P = 16


def setup():
    return K3RadixTree(num_groups=1, page_size=P, hit_unit=1), PagedPool(1000, P), IntPool(100)


def put(tree, kv, key, ragged=False, row=None):
    row = kv.alloc_row(len(key)) if row is None else row
    r = tree.insert(key, row, ragged=ragged)
    kv.free(r.duplicate_kv + row[r.inserted_len :])
    tree.check_invariants()
    return r


def state(tree, h, node, pos):
    return tree.add_checkpoint(node, pos, h.alloc(1), nbytes=10, kind=CheckpointKind.GEN_END, ready=True)


def test_a_ragged_end_keeps_its_partial_page_and_restores_inside_it():
    tree, kv, h = setup()
    turn1 = list(range(70))  # 4 whole pages and 6 tokens
    plain = put(tree, kv, turn1)
    assert plain.inserted_len == 64  # a running request's partial page stays its own
    r = put(tree, kv, turn1, ragged=True)
    assert r.inserted_len == 70 and r.node.end == 70 and r.node.is_leaf and r.node.parent.ragged == 1
    ck = state(tree, h, r.node, 70)
    m = tree.match_prefix(turn1 + [500, 501], pin=False)
    assert (m.mla_len, m.restore_len, m.kv_cow_tokens) == (70, 70, 6)
    assert m.checkpoint is ck and m.kv_indices == tree.path_kv(r.node)


def test_a_request_going_on_through_the_page_takes_over_the_ragged_state():
    tree, kv, h = setup()
    turn1 = list(range(70))
    put(tree, kv, turn1)
    ragged = put(tree, kv, turn1, ragged=True).node
    ck = state(tree, h, ragged, 70)
    turn2 = turn1 + list(range(1000, 1040))  # 110 tokens: pages 4..6 are its own
    tree.inc_lock_ref(ragged)  # it is running off the ragged state: the leaf is locked
    put(tree, kv, turn2)  # its chunk end: the ragged leaf cannot go yet
    assert ragged.parent is not None and ck.node is ragged
    assert tree.match_prefix(turn1 + [9, 9], pin=False).checkpoint is ck  # still found through it
    tree.dec_lock_ref(ragged)
    put(tree, kv, turn2, ragged=True)  # its finish passes through the same page: absorbed now
    assert ragged.parent is None and ck.node is not None and ck.node.start < 70 <= ck.node.end
    assert len(ck.node.key) % P == 0 and tree.root.children and tree.check_invariants() is None
    m = tree.match_prefix(turn1 + [9, 9], pin=False)
    assert (m.restore_len, m.kv_cow_tokens) == (70, 6) and m.checkpoint is ck
    assert all(i // P != j // P for i in m.kv_indices[64:] for j in ragged.kv), "restores from the new page"


def test_a_ragged_end_another_node_already_holds_is_a_duplicate():
    tree, kv, h = setup()
    long = list(range(100))
    full = put(tree, kv, long, ragged=True).node
    r = put(tree, kv, long[:70], ragged=True)
    assert r.inserted_len == 70 and r.node is full and tree._leaves() == [full]  # no second leaf
    assert state(tree, h, r.node, 70).node is full  # the exact end sits inside the node


def test_evicting_and_trimming_ragged_leaves_frees_whole_pages_and_keeps_counts():
    tree, kv, h = setup()
    a = put(tree, kv, list(range(70)), ragged=True).node
    b = put(tree, kv, list(range(64)) + [900, 901, 902], ragged=True).node
    assert a.parent is b.parent and a.parent.ragged == 2
    freed = tree.evict(num_tokens=10**6)
    kv.free(freed.kv_indices)
    tree.check_invariants()
    assert tree.total_size() == 0 and not kv.allocated and tree.root.ragged == 0
