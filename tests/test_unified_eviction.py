"""How a shortage in the unified budget is met (``sglang_k3/cache/unified_eviction.py``), driven
through the real ledger, lifecycle and tree with the replay's int-handle store: evicting for one
checkpoint takes one, and a state slot is freed by taking the least valuable slot's borrowers."""

from __future__ import annotations

from int_pools import IntPool

from benchmarks.policies.k3 import SimulatedStore
from sglang_k3.cache import EvictionPolicy
from sglang_k3.cache.block_ledger import BlockGeometry, BlockLedger
from sglang_k3.cache.build import build_lifecycle
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
    cks = [place(lc, kv, t) for t in range(led.free_blocks())]
    assert not led.ckpt_has_room()
    evictor.for_checkpoint(CKPT)
    assert led.ckpt_has_room()
    assert lc.tree.stats.evicted_checkpoints == 1
    assert sum(ck.node is None for ck in cks) == 1
    led.check()


def test_a_state_slot_takes_the_least_valuable_borrowers_not_the_fewest():
    """Checkpoints borrowed both region slots: one slot holds three cold turn ends, the other one
    state that thirty requests restored from since. A new active state evicts the three cold ones
    (it took the slot holding the fewest checkpoints before: the hot one)."""
    led, lc, evictor, kv = build()
    cold = [place(lc, kv, t) for t in range(6)]  # blocks 5,4,3 then 11,10,9 (region slot 3)
    hot = place(lc, kv, 99)  # block 8 (region slot 2, alone)
    for c in range(30):
        res = lc.tree.match_prefix([99] * 64 + [c])  # pinned: a restore, counted as a hit
        assert res.restore_len == 64
        lc.tree.release_pin(res.pin)
    assert sorted(len(v) for v in led.active_victims()) == [1, 3]
    evictor.for_active(1)
    assert led.active_alloc() is not None
    assert hot.node is not None
    assert [ck.node is None for ck in cold] == [False] * 3 + [True] * 3
    led.check()
