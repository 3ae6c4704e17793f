"""Eviction reads the waiting queue: what a queued request will restore from goes last, the
queue's tail first (``K3RadixTree.touch``, ``eviction.rank``). Torch-free."""

import random

from int_pools import IntPool

from sglang_k3.cache import EvictionPolicy, K3RadixTree


def build(alpha=1.0):
    tree = K3RadixTree(num_groups=1, page_size=1, hit_unit=64, eviction=EvictionPolicy(alpha=alpha))
    return tree, IntPool(100_000), IntPool(1000)


def conversation(tree, kv, h, tag, length=256):
    """A finished turn: its KV and the checkpoint at its end."""
    key = [tag] * length
    node = tree.insert(key, kv.alloc(length)).node
    return key, tree.add_checkpoint(node, length, h.alloc(1), nbytes=1000, ready=True)


def refresh(tree, queue):
    """SGLang's refresh: the waiting requests' prompts touched tail first, head last."""
    for prompt in reversed(queue):
        tree.touch(prompt)


def evicted_order(tree, n):
    out = []
    for _ in range(n):
        freed = tree.evict(num_bytes=1)
        assert len(freed.handles) == 1
        out.append(freed.handles[0])
    return out


def test_unwanted_go_first_then_the_queue_from_its_tail():
    tree, kv, h = build()
    convs = [conversation(tree, kv, h, tag) for tag in range(1, 7)]
    queue = [convs[i][0] + [99] for i in (4, 1, 3)]  # next turns of 5, 2, 4 wait, in this order
    refresh(tree, queue)
    ck = [c for _, c in convs]
    # 1, 3, 6 no one waits for (oldest first, as LRU); then the queue's tail (4), 2, and the head (5) last
    assert evicted_order(tree, 6) == [ck[i].handles[0] for i in (0, 2, 5, 3, 1, 4)]
    tree.check_invariants()


def test_a_turn_that_finished_after_the_refresh_goes_before_the_queued_ones():
    """Plain LRU keeps the turn that just finished (the most recent) and evicts the queued turns'
    states: under a budget too small for all conversations, each is lost just before its turn."""
    tree, kv, h = build(alpha=0)
    convs = [conversation(tree, kv, h, tag) for tag in range(1, 4)]
    refresh(tree, [c[0] + [99] for c in convs])  # all three wait, 1 at the head
    _, fresh = conversation(tree, kv, h, 4)  # a turn finishes; its next turn is not queued yet
    assert evicted_order(tree, 2) == [fresh.handles[0], convs[2][1].handles[0]]


def test_a_new_refresh_ends_the_last_ones_wants():
    tree, kv, h = build(alpha=0)
    (ka, a), (kb, b) = conversation(tree, kv, h, 1), conversation(tree, kv, h, 2)
    refresh(tree, [ka + [9]])
    assert tree.wanted(a) and not tree.wanted(b)
    tree.match_prefix([5] * 10, pin=False)  # the scheduler moves on: other lookups, inserts
    refresh(tree, [kb + [9]])  # a's request was admitted or left
    assert not tree.wanted(a) and tree.wanted(b)
    assert evicted_order(tree, 1) == a.handles


def test_an_admitted_match_keeps_the_want_for_the_rest_of_the_queue():
    """Other queued requests may restore from the same checkpoint (a shared system prompt): the
    first one's admission must not expose it to the allocations that follow."""
    tree, kv, h = build(alpha=0)
    (ka, a), (kb, b) = conversation(tree, kv, h, 1), conversation(tree, kv, h, 2)
    refresh(tree, [ka + [9], ka + [8]])
    res = tree.match_prefix(ka + [9])  # the head is admitted
    assert res.checkpoint is a and tree.wanted(a)
    tree.release_pin(res.pin)
    tree.match_prefix(kb + [7], pin=False)  # b becomes the most recent; nothing queued wants it
    assert evicted_order(tree, 1) == b.handles
    tree.check_invariants()


def test_kv_eviction_spares_the_leaves_the_queue_restores_from():
    tree, kv, h = build(alpha=0)
    (ka, _), (kb, b) = conversation(tree, kv, h, 1), conversation(tree, kv, h, 2)
    refresh(tree, [ka + [9]])
    tree.match_prefix(kb + [9], pin=False)  # b is the most recent, a is wanted
    freed = tree.evict(num_tokens=1)
    assert freed.handles == b.handles and len(freed.kv_indices) == 256
    assert tree.match_prefix(ka + [9], pin=False).restore_len == 256


def test_a_superseded_checkpoint_a_queued_request_wants_is_not_swept_first():
    tree, kv, h = build(alpha=0)
    (ka, a), (_, b) = conversation(tree, kv, h, 1), conversation(tree, kv, h, 2)
    a.superseded = b.superseded = True
    refresh(tree, [ka + [9]])
    assert evicted_order(tree, 2) == [b.handles[0], a.handles[0]]


def test_random_refreshes_keep_the_order_and_the_invariants():
    """Seeded: after any refresh, every unwanted checkpoint is evicted before any wanted one,
    and the wanted ones leave in queue order, tail first."""
    for seed in range(20):
        rng = random.Random(seed)
        tree, kv, h = build(alpha=rng.choice([0.0, 0.3, 1.0]))
        convs = [conversation(tree, kv, h, tag, 64 * rng.randint(1, 4)) for tag in range(1, 11)]
        for key, _ in rng.sample(convs, 4):
            tree.match_prefix(key + [9], pin=False)
        waiting = rng.sample(convs, rng.randint(1, 6))
        refresh(tree, [k + [9] for k, _ in waiting])
        order = evicted_order(tree, len(convs))
        wanted = [c.handles[0] for _, c in waiting]
        assert order[len(convs) - len(wanted) :] == wanted[::-1], seed
        tree.check_invariants()


def test_an_emptied_queue_ends_the_wants():
    tree, kv, h = build(alpha=0)
    (ka, a), (kb, _) = conversation(tree, kv, h, 1), conversation(tree, kv, h, 2)
    refresh(tree, [ka + [9]])  # a's request waits, then leaves without a match (aborted)
    tree.end_wants()
    assert not tree.wanted(a)
    tree.match_prefix(kb + [9], pin=False)
    assert evicted_order(tree, 1) == a.handles  # LRU again


def test_room_for_a_new_checkpoint_never_evicts_a_wanted_one():
    """A queued request's want is a known next use; a new state's use is a guess. Room for a new
    checkpoint (``spare_wanted``) takes only what no waiting request wants, and gets nothing when
    everything is wanted; room for KV (which a running request must have) still takes them, the
    queue's tail first."""
    tree, kv, h = build()
    convs = [conversation(tree, kv, h, tag) for tag in range(1, 4)]
    refresh(tree, [convs[i][0] + [99] for i in (0, 1)])  # 1 at the head, then 2; nobody wants 3
    ck = [c for _, c in convs]
    freed = tree.evict(num_bytes=1, spare_wanted=True)
    assert freed.handles == ck[2].handles
    assert tree.evict(num_bytes=1, spare_wanted=True).handles == []  # only wanted ones are left
    assert tree.checkpoint_count() == 2
    assert tree.evict_ranked(1, spare_wanted=True).handles == []
    assert tree.evict(num_bytes=1).handles == ck[1].handles  # not sparing: the tail goes first
    tree.check_invariants()


def test_a_shared_state_a_queued_request_falls_back_to_is_wanted_too():
    """Two conversations over one system prompt, each with a state at its own turn end and a
    shared one where they part. Both wait: their turn ends are wanted, and so is the shared state
    under them (if a turn end goes, its request restores there). A finished conversation no one
    waits for goes before it. Without the fallback want, the shared state, older than every turn
    end, went first under a tie of recency against efficiency, and the queued requests whose turn
    ends went next missed the system prompt too (seen on the live A/B's ``multiturn`` under
    ``--pressure``)."""
    tree, kv, h = build()
    system = [7] * 128
    ends = []
    for tag in (1, 2, 3):
        key = system + [tag] * 128
        node = tree.insert(key, kv.alloc(len(key))).node
        ends.append((key, tree.add_checkpoint(node, len(key), h.alloc(1), nbytes=1000, ready=True)))
    node = tree._walk(system)[0][-1]  # the conversations part at 128: a node ends there
    assert node.end == 128
    shared = tree.add_checkpoint(node, 128, h.alloc(1), nbytes=1000, ready=True)
    assert tree.is_branch_point(shared)
    refresh(tree, [ends[0][0] + [99], ends[1][0] + [99]])  # 3 finished; its next turn is not queued
    assert tree.wanted(shared) and tree.wanted(ends[0][1]) and not tree.wanted(ends[2][1])
    assert evicted_order(tree, 1) == ends[2][1].handles
    tree.check_invariants()
