"""The radix tree's self-check: recompute its bookkeeping from scratch and assert the incremental
state agrees (:meth:`~sglang_k3.cache.tree.K3RadixTree.check_invariants`, called by the tests and
the soak after every step). Torch-free."""

from __future__ import annotations

from sglang_k3.cache.node import Checkpoint


def check_tree(tree) -> None:
    """Every node's links, keys, KV and locks; every checkpoint's place, pins and handles; the
    evictable/protected token counts, checkpoint counts and bytes, and the stuck sets of ``tree``,
    a :class:`~sglang_k3.cache.tree.K3RadixTree` (not imported: the tree imports this module, and
    the check reads its private bookkeeping, so it belongs to the tree alone)."""
    seen_kv: set[int] = set()
    seen_h: dict[int, Checkpoint] = {}
    ev = pr = nck = nbytes = 0
    stack = [tree.root]
    while stack:
        n = stack.pop()
        for head, c in n.children.items():
            assert c.parent is n and c.start == n.end and len(c.key) > 0, c
            assert tuple(c.key[: tree.page_size]) == head and len(c.key) == len(c.kv)
            assert not tree._ragged(c) or c.is_leaf, c  # only a leaf may end inside a page
            assert 0 <= c.lock_ref <= n.lock_ref or n is tree.root, (n, c)
            stack.append(c)
        assert n.ragged == sum(map(tree._ragged, n.children.values())), n
        if n is tree.root:
            continue
        assert n.lock_ref >= 0
        for i in n.kv:
            assert i not in seen_kv, f"KV index {i} held twice"
            seen_kv.add(i)
        if n.lock_ref:
            pr += tree._slots(n)
        else:
            ev += tree._slots(n)
        for pos, ck in n.checkpoints.items():
            assert ck.pos == pos and ck.node is n and n.start < pos <= n.end and pos % tree.hit_unit == 0
            assert ck.pins >= 0 and (ck.pins == 0 or n.lock_ref >= ck.pins)
            assert ck.ready or ck.id in tree._pending
            nck += 1
            nbytes += ck.nbytes
            for h in ck.held_handles():
                assert h not in seen_h, f"handle {h} held twice"
                seen_h[h] = ck
    assert (ev, pr) == (tree._evictable_tokens, tree._protected_tokens), (ev, pr)
    assert nck == len(tree._ckpts) == tree.stats.checkpoints and nbytes == tree.stats.checkpoint_bytes
    assert seen_h == tree._handle_owner
    stuck = {c.id for c in tree._ckpts.values() if not tree.checkpoint_evictable(c)}
    assert stuck == tree._stuck and tree._stuck_bytes == sum(tree._ckpts[i].nbytes for i in stuck)
    assert tree._stuck_free == {i for i in stuck if not tree._ckpts[i].node.lock_ref}
