"""How a shortage in the unified budget is met (``sglang_k3/cache/unified_eviction.py``), driven
through the real ledger, lifecycle and tree with the replay's int-handle store: evicting for one
checkpoint takes one, and a state beyond the reserve gets a run of blocks outside the region
unless a checkpoint there is pinned."""

from __future__ import annotations

from int_pools import IntPool

from benchmarks.policies.k3 import SimulatedStore
from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.block_ledger import BlockGeometry, BlockLedger
from sglang_k3.cache.lifecycle import build_lifecycle
from sglang_k3.cache.unified_eviction import UnifiedEviction
from sglang_k3.config import K3Config

# a checkpoint is 9,600 B in a 10,000 B stride (one per block, as at 48B int8 sizes), and an active
# state spans three blocks; blocks 0-2 are the padding slot, 3-5 outside the region, 6-11 region
CKPT = 9_600
GEOM = BlockGeometry(
    num_blocks=12,
    block_bytes=10_000,
    kv_token_bytes=100,
    kv_per_block=100,
    active_bytes=30_000,
    ckpt_bytes=CKPT,
    ckpt_stride=10_000,
    ckpt_per_block=1,
    active_span=3,
)


def build():
    led = BlockLedger(GEOM, active_reserve=2)
    kv = IntPool(10_000)
    evictor = None

    def evict_bytes(n):
        evictor.for_checkpoint(n)

    store = SimulatedStore("int8", CKPT, None, evict_bytes, led)
    lc = build_lifecycle(K3Config(), store, EvictionPolicy(), kv.free)
    evictor = UnifiedEviction(lc, led)
    return led, lc, evictor, kv


def place(lc, kv, tag: int, length: int = 64):
    """A leaf of ``length`` tokens with a landed checkpoint at its end, in a ledger handle."""
    tree = lc.tree
    r = tree.insert([tag] * length, kv.alloc(length))
    h = lc.store.alloc()
    assert h is not None
    return tree.add_checkpoint(r.node, length, [h], nbytes=CKPT, ready=True)


def test_room_for_one_checkpoint_evicts_one():
    """The budget is full of checkpoints. Asking room for one more evicts exactly one: the stride
    (a block) is more than a checkpoint's bytes, and stepping by the block took a second."""
    led, lc, evictor, kv = build()
    cks = [place(lc, kv, t) for t in range(led.kv_blocks_takeable())]  # every block outside the region
    assert not led.ckpt_has_room()
    evictor.for_checkpoint(CKPT)
    assert led.ckpt_has_room()
    assert lc.tree.stats.evicted_checkpoints == 1
    assert sum(ck.node is None for ck in cks) == 1
    led.check()


def test_a_state_beyond_the_reserve_evicts_a_run_outside_the_region_unless_pinned():
    """Both region slots hold states; a third state (a reserve capped below SGLang's rows) needs
    the one aligned run outside, blocks 3-5, which three checkpoints hold. While a hit being
    restored pins one of them the run cannot be freed; once the pin is released it is."""
    led, lc, evictor, kv = build()
    assert sorted(led.active_alloc() for _ in range(2)) == sorted(led.region_slots)
    cks = [place(lc, kv, t) for t in range(3)]
    assert led.free_blocks() == 0
    res = lc.tree.match_prefix([0] * 64 + [7])  # a hit on the first: pinned until its copy lands
    assert res.restore_len == 64 and res.checkpoint is cks[0]
    evictor.for_active(1)
    assert led.free_slots() == 0 and cks[0].node is not None
    lc.tree.release_pin(res.pin)
    evictor.for_active(1)
    assert led.free_slots() == 1 and all(ck.node is None for ck in cks)
    assert led.active_alloc() == 1
    led.check()
