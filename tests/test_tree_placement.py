"""Placement flags and recycling of superseded intermediate checkpoints."""

from int_pools import IntPool

from sglang_k3.cache import CheckpointKind as K
from sglang_k3.cache import K3RadixTree, PlacementPolicy


def test_plan_prefill_positions_and_flags():
    pol = PlacementPolicy()
    plan = pol.plan_prefill(prompt_len=1000, chunk_ends=[256, 512, 768, 1000], branch_point=300)
    # the last chunk ends at the prompt end, which PROMPT_END covers (rounded down to 960)
    assert plan == {256: K.CHUNK | K.BRANCH, 512: K.CHUNK, 768: K.CHUNK, 960: K.PROMPT_END}
    off = PlacementPolicy(at_chunk_end=False, at_branch_points=False)
    assert off.plan_prefill(1000, [256, 512, 1000], branch_point=300) == {960: K.PROMPT_END}
    assert pol.plan_prefill(1000, [512, 1000], restore_len=512) == {960: K.PROMPT_END}


def test_decode_interval_and_generation_end():
    pol = PlacementPolicy(decode_interval=1024)
    assert pol.decode_checkpoint(2048) and not pol.decode_checkpoint(2049)
    assert not PlacementPolicy().decode_checkpoint(2048)
    # a speculative verify commits several tokens: due when the step crossed a multiple, at the
    # length after it if a hit can land there (hit_unit), never twice for one multiple
    one = PlacementPolicy(decode_interval=1024, hit_unit=1)
    assert one.decode_checkpoint(2050, advanced=4) and one.decode_checkpoint(2048, advanced=4)
    assert not one.decode_checkpoint(2047, advanced=4) and not one.decode_checkpoint(2052, advanced=4)
    assert not pol.decode_checkpoint(2050, advanced=4)  # 2050 is no multiple of its 64-token hit unit
    assert pol.generation_end(1000) == 960 and pol.generation_end(10) is None
    assert PlacementPolicy(at_generation_end=False).generation_end(1000) is None


def run_request(tree, h, kv, key, positions):
    r = tree.insert(key, kv.alloc(len(key)))
    cks = {p: tree.add_checkpoint(r.node, p, h.alloc(1), 10, kind=k, ready=True) for p, k in positions.items()}
    return r.node, cks


def test_recycle_drops_superseded_chunks_but_keeps_branch_points_and_turn_ends():
    tree, kv, h = K3RadixTree(num_groups=1), IntPool(10_000), IntPool(100)
    key = list(range(1024))
    node, cks = run_request(tree, h, kv, key, {256: K.CHUNK, 512: K.PROMPT_END, 768: K.CHUNK, 1024: K.CHUNK})
    sib = tree.insert(key[:768] + [-1] * 64, kv.alloc(832)).node  # a sibling forks at 768
    tree.add_checkpoint(sib, 832, h.alloc(1), 10, kind=K.GEN_END, ready=True)  # ... and keeps a state: a live path
    node = tree.match_prefix(key + [0], pin=False).node
    freed = tree.recycle_path(node, PlacementPolicy())
    assert freed.handles == cks[256].handles
    assert sorted(c.pos for c in tree.path_checkpoints(node)) == [512, 768, 1024]
    assert tree.stats.recycled_checkpoints == 1


def test_a_dead_stub_sibling_is_not_a_branch_point():
    """A leaf with no checkpoint and no lock (e.g. a prompt's tail past its last state, forked off
    inside a page by the same request's longer sequence) is no path to restore along: the
    checkpoint where it hangs stays recyclable and within the per-path cap."""
    tree, kv, h = K3RadixTree(num_groups=1), IntPool(10_000), IntPool(100)
    key = list(range(1024))
    node, cks = run_request(tree, h, kv, key, {256: K.CHUNK, 768: K.CHUNK, 1024: K.GEN_END})
    stub = tree.insert(key[:768] + [-1] * 64, kv.alloc(832)).node
    assert not tree.is_branch_point(cks[768])
    tree.inc_lock_ref(stub)  # a running request on it: a live path
    assert tree.is_branch_point(cks[768])
    tree.dec_lock_ref(stub)
    node = tree.match_prefix(key + [0], pin=False).node
    assert sorted(tree.recycle_path(node, PlacementPolicy()).handles) == sorted(cks[256].handles + cks[768].handles)


def test_per_path_budget():
    tree, kv, h = K3RadixTree(num_groups=1), IntPool(10_000), IntPool(100)
    key = list(range(1024))
    pos = {p: K.PROMPT_END for p in range(128, 1025, 128)}  # 8 non-recyclable kinds
    node, cks = run_request(tree, h, kv, key, pos)
    freed = tree.recycle_path(node, PlacementPolicy(per_path_budget=3))
    assert sorted(c.pos for c in tree.path_checkpoints(node)) == [768, 896, 1024]
    assert len(freed.handles) == 5


def test_recycle_skips_pinned_and_unlanded():
    tree, kv, h = K3RadixTree(num_groups=1), IntPool(10_000), IntPool(100)
    key = list(range(512))
    node, cks = run_request(tree, h, kv, key, {128: K.CHUNK, 512: K.CHUNK})
    m = tree.match_prefix(key[:200])  # pins 128
    assert tree.recycle_path(node, PlacementPolicy()).handles == []
    tree.release_pin(m.pin)
    assert tree.recycle_path(node, PlacementPolicy()).handles == cks[128].handles


def test_export_candidates_prompt_end_and_branch_point():
    pol = PlacementPolicy()
    grid = [64, 128, 192, 256]  # an extend of [0, 300)
    assert pol.export_candidates(grid, 300, prompt_len=300, branch_point=150) == {256: K.PROMPT_END, 128: K.BRANCH}
    assert pol.export_candidates(grid, 300, prompt_len=300, branch_point=256) == {256: K.PROMPT_END | K.BRANCH}
    assert pol.export_candidates(grid, 300, prompt_len=1000, branch_point=150) == {128: K.BRANCH}  # a middle chunk
    assert pol.export_candidates(grid, 300, prompt_len=None) == {256: K.PROMPT_END}  # unknown: taken as reached
    assert pol.export_candidates(grid, 300, prompt_len=300, branch_point=40) == {256: K.PROMPT_END}  # none below
    assert pol.export_candidates([], 50, prompt_len=50, branch_point=10) == {}
    assert PlacementPolicy(at_prompt_end=False).export_candidates(grid, 300, 300, 150) == {128: K.BRANCH}
    assert PlacementPolicy(at_branch_points=False).export_candidates(grid, 300, 300, 150) == {256: K.PROMPT_END}
