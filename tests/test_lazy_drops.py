"""Lazy drops (``Retention.let_go``): a state the placement rules let go (one state per turn,
recycling superseded chunk ends, the per-path cap) stays while the budget has free memory, still
matchable, and goes first at the next shortage; the rest of the cache ranks as if it had gone.

Each test drives the shared request lifecycle with a ``has_slack`` probe the test controls (the
server and the replay pass the unified ledger's ``BlockLedger.has_slack``)."""

from __future__ import annotations

from sglang_k3.cache import CheckpointKind as K
from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.block_ledger import BlockLedger, plan_geometry
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.ranking import Candidate, rank
from sglang_k3.config import K3Config
from tests.test_lifecycle import IntStore, _turn


class Slack:
    """The budget's free memory, as the test sets it."""

    def __init__(self, free: bool = True) -> None:
        self.free = free

    def __call__(self) -> bool:
        return self.free


def _lc(slack, **cfg):
    store = IntStore()
    cfg.setdefault("adaptive_retention", False)  # the rules alone: what the learner keeps is test_ghosts'
    lc = build_lifecycle(K3Config(**cfg), store, EvictionPolicy(), lambda idx: None, has_slack=slack)
    return lc, store


def _cks(lc, node):
    return {c.pos: c for c in lc.tree.path_checkpoints(node)}


def test_a_superseded_turn_state_stays_deferred_while_memory_is_free_and_serves_a_fork():
    slack = Slack(True)
    lc, store = _lc(slack)
    key = list(range(300))
    node = _turn(lc, "a", key, [900, 901], slot=1)
    cks = _cks(lc, node)
    # one state per turn would have dropped the prompt end (test_lifecycle); memory is free: it stays
    assert sorted(cks) == [300, 302] and cks[300].deferred and not cks[302].deferred
    assert lc.tree.stats.recycled_checkpoints == 0 and lc.tree.stats.deferred_checkpoints == 1
    assert len(store.live) == 2
    # a fork inside the answer restores from it, and the hit makes it a state like any other
    fork = key + [777]
    assert lc.match(None, fork, admit=False).restore_len == 300
    lc.match("b", fork, admit=True, prompt_len=len(fork))
    assert not cks[300].deferred and cks[300].hits == 1 and lc.tree.stats.deferred_hits == 1
    lc.release("b")
    lc.tree.check_invariants()


def test_without_free_memory_the_rule_drops_at_once():
    lc, store = _lc(Slack(False))
    node = _turn(lc, "a", list(range(300)), [900, 901], slot=1)
    assert sorted(_cks(lc, node)) == [302]
    assert lc.tree.stats.recycled_checkpoints == 1 and lc.tree.stats.deferred_checkpoints == 0
    assert len(store.live) == 1
    # and with lazy drops off (--k3-eager-drops) free memory changes nothing
    lc, _ = _lc(Slack(True), lazy_drops=False)
    node = _turn(lc, "a", list(range(300)), [900, 901], slot=1)
    assert sorted(_cks(lc, node)) == [302]


def test_at_a_shortage_deferred_states_go_first_whatever_they_would_save():
    """Three conversations; memory free while they finish, so each leaves a deferred prompt-end
    state. The deferred ones are older than every turn end but one, and save as much: by value
    and recency some turn end would go first. They go first, all of them, before any other, and
    as recycled states (the rule's drop, late), not as evictions."""
    slack = Slack(True)
    lc, store = _lc(slack)
    nodes = [_turn(lc, f"r{i}", [i] * 300, [900 + i], slot=i + 1) for i in range(3)]
    deferred = [c for n in nodes for c in lc.tree.path_checkpoints(n) if c.deferred]
    assert len(deferred) == 3 and lc.tree.checkpoint_count() == 6
    slack.free = False
    lc.evict_until(lambda: lc.tree.checkpoint_count() <= 3, step_bytes=1)
    left = lc.tree.checkpoints()
    assert sorted(c.pos for c in left) == [301, 301, 301] and not any(c.deferred for c in left)
    assert lc.tree.stats.evicted_checkpoints == 0 and lc.tree.stats.recycled_checkpoints == 3
    assert len(store.live) == 3
    lc.tree.check_invariants()


def test_rank_puts_deferred_candidates_first_and_leaves_the_rest_in_their_own_order():
    cands = [
        Candidate("old-cheap", last_access=1, saved_flops=1.0, nbytes=1),
        Candidate("new-rich", last_access=9, saved_flops=1e6, nbytes=1),
        Candidate("mid", last_access=5, saved_flops=1e3, nbytes=1),
    ]
    base = [c.obj for c in rank(cands, alpha=1.0)]
    lazy = [
        Candidate("deferred-rich-new", last_access=10, saved_flops=1e9, nbytes=1, deferred=True),
        Candidate("deferred-old", last_access=0, saved_flops=1e9, nbytes=1, deferred=True),
    ]
    got = [c.obj for c in rank([*cands, *lazy], alpha=1.0)]
    assert got[:2] == ["deferred-old", "deferred-rich-new"]  # oldest first among them
    assert got[2:] == base  # they take no part in the others' normalisation
    # a deferred state a waiting request wants is a known use: it goes last, with the wanted
    wanted = Candidate("deferred-wanted", last_access=0, saved_flops=1.0, nbytes=1, wanted=3, deferred=True)
    assert [c.obj for c in rank([*cands, wanted], alpha=1.0)][-1] == "deferred-wanted"


def test_a_deferred_state_does_not_lower_what_a_deeper_state_saves():
    """The price of a state is the prefill it saves over the next earlier state on its path. A
    deferred state there is counted as gone, as the rule meant: the deeper state's price is what
    it was when the rule dropped at once."""
    eager, _ = _lc(Slack(False))
    lazy, _ = _lc(Slack(True))
    key = list(range(300))
    for lc in (eager, lazy):
        _turn(lc, "a", key, [900, 901], slot=1)
        _turn(lc, "b", key + [900, 901, 5, 6], [7], slot=2)
    deep_eager = max(eager.tree.checkpoints(), key=lambda c: c.pos)
    deep_lazy = max(lazy.tree.checkpoints(), key=lambda c: c.pos)
    assert any(c.deferred for c in lazy.tree.checkpoints())
    assert deep_lazy.pos == deep_eager.pos
    assert lazy.tree.saved_flops(deep_lazy) == eager.tree.saved_flops(deep_eager)
    assert lazy.tree.expected_saving(deep_lazy) == eager.tree.expected_saving(deep_eager)


def test_the_per_path_cap_counts_only_states_that_stay():
    """A cap of 3 states per path, four on the path, one of them deferred (a rule let it go while
    memory was free): three stay, so the cap takes none. Counting the deferred one, the cap would
    recycle a live state the rule never meant to drop."""
    from sglang_k3.cache import K3RadixTree
    from sglang_k3.cache.placement import PlacementPolicy

    tree = K3RadixTree(num_groups=1, hit_unit=1, has_slack=Slack(True))
    node = tree.insert(list(range(1024)), list(range(1024))).node
    cks = {p: tree.add_checkpoint(node, p, [p], nbytes=1, kind=K.PROMPT_END, ready=True) for p in (256, 512, 768, 1024)}
    tree.mark_deferred(cks[512])
    policy = PlacementPolicy(per_path_budget=3, recycle_superseded=False)
    tree.recycle_path(node, policy)
    assert not any(cks[p].deferred for p in (256, 768, 1024)) and all(c.node is not None for c in cks.values())
    # one more live state: now the cap takes the shallowest live one (deferred, since memory is free)
    cks[1000] = tree.add_checkpoint(node, 1000, [1000], nbytes=1, kind=K.PROMPT_END, ready=True)
    tree.recycle_path(node, policy)
    assert cks[256].deferred and not any(cks[p].deferred for p in (768, 1000, 1024))


def test_the_ledger_reports_slack_while_a_block_is_free():
    geom = plan_geometry(64 * 4096, kv_token_bytes=64, active_bytes=4096, ckpt_bytes=4096)
    led = BlockLedger(geom, active_reserve=0)
    assert led.has_slack()
    got = []
    while (h := led.ckpt_alloc()) is not None:
        got.append(h)
    assert got and not led.has_slack() and led.free_blocks() == 0
    led.ckpt_free(got[0])
    assert led.has_slack() == (led.free_blocks() > 0)


def _tree(free=True):
    from sglang_k3.cache import K3RadixTree

    return K3RadixTree(num_groups=1, hit_unit=1, has_slack=Slack(free))


def test_a_child_with_only_deferred_states_is_no_fork():
    """Where two paths part, the state at the split is kept as a branch state. A child whose
    only states are deferred is, for that rule, a dead stub, as it is once they are dropped."""
    tree = _tree()
    a = [1] * 512
    tree.insert(a + [2] * 256, list(range(768)))
    tree.insert(a + [3] * 256, list(range(1000, 1768)))
    mid = next(iter(tree.root.children.values()))  # the shared 512 tokens, split where the two part
    assert mid.end == 512
    at_split = tree.add_checkpoint(mid, 512, [1], nbytes=1, kind=K.PROMPT_END, ready=True)
    kids = list(mid.children.values())
    live = tree.add_checkpoint(kids[0], 768, [2], nbytes=1, kind=K.GEN_END, ready=True)
    other = tree.add_checkpoint(kids[1], 768, [3], nbytes=1, kind=K.GEN_END, ready=True)
    assert tree.is_branch_point(at_split)
    tree.mark_deferred(other)
    assert live.node is not None and not tree.is_branch_point(at_split)


def test_the_repeat_state_is_found_past_deferred_deeper_states():
    """The state a repeat of the prompt restores from is the deepest one strictly inside the
    prompt that stays; a deeper deferred one does not take that role from it."""
    tree = _tree()
    node = tree.insert(list(range(300)), list(range(300))).node
    grid = tree.add_checkpoint(node, 256, [1], nbytes=1, kind=K.PROMPT_END, ready=True)
    deeper = tree.add_checkpoint(node, 288, [2], nbytes=1, kind=K.CHUNK, ready=True)
    tree.mark_deferred(deeper)
    assert tree._repeat_state(grid, [grid, deeper], prompt_len=300, keep_repeat_state=True)
    deeper.deferred = False
    assert not tree._repeat_state(grid, [grid, deeper], prompt_len=300, keep_repeat_state=True)


def test_the_kv_a_state_keeps_alive_counts_deferred_states_as_gone():
    """Dropping a leaf's last state lets the KV past the state before it go; a deferred state
    deeper on the leaf does not make the live one look free of KV."""
    tree = _tree()
    node = tree.insert(list(range(512)), list(range(512))).node
    low = tree.add_checkpoint(node, 256, [1], nbytes=1, kind=K.PROMPT_END, ready=True)
    high = tree.add_checkpoint(node, 512, [2], nbytes=1, kind=K.GEN_END, ready=True)
    assert tree._kv_freed_with(low) == 0  # high keeps the KV alive
    tree.mark_deferred(high)
    assert tree._kv_freed_with(low) == tree.policy.kv_bytes(256)
