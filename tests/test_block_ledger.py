"""The unified budget's block ledger: random allocate/free sequences of all three kinds never give
two live allocations overlapping bytes, never leak, and account every byte to exactly one kind;
after everything is freed, every usable byte is free in one run."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_k3.cache.block_ledger import BlockLedger, Kind, LedgerError, plan_geometry

# the embedded model's sizes: MLA KV 1,280 B/token, an fp32 KDA state 420,864 B, an int8
# checkpoint about a third of it
GEOM = plan_geometry(40 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=150_000)


def _intervals(led: BlockLedger, kv: set, active: set, ckpts: set) -> list[tuple[int, int, str]]:
    g = led.geom
    out = [(t * g.kv_token_bytes, (t + 1) * g.kv_token_bytes, "kv") for t in kv]
    out += [(b * g.block_bytes, b * g.block_bytes + g.active_bytes, "active") for b in active]
    for h in ckpts:
        b, sub = divmod(h, g.ckpt_per_block)
        start = b * g.block_bytes + sub * g.ckpt_stride
        out.append((start, start + g.ckpt_bytes, "ckpt"))
    return sorted(out)


def _check(led: BlockLedger, kv: set, active: set, ckpts: set) -> None:
    led.check()
    g = led.geom
    iv = _intervals(led, kv, active, ckpts)
    for (s0, e0, k0), (s1, _, k1) in zip(iv, iv[1:]):
        assert e0 <= s1, f"{k0} [{s0},{e0}) overlaps {k1} at {s1}"
    for s, e, _ in iv:
        assert g.block_bytes <= s and e <= g.budget_bytes  # never in the padding block
    split = led.bytes_by_kind()
    assert (
        split["kv_bytes"]
        + split["active_bytes"]
        + split["checkpoint_bytes"]
        + split["free_bytes"]
        + split["reserved_bytes"]
        == g.budget_bytes
    )
    assert split["kv_used_bytes"] == len(kv) * g.kv_token_bytes
    assert split["checkpoint_used_bytes"] == len(ckpts) * g.ckpt_stride
    assert split["active_bytes"] == len(active) * g.block_bytes
    assert led.ckpt_count() == len(ckpts) and led.active_count() == len(active)
    assert led.kv_capacity() == led.kv_available() + len(kv)  # the idle leak check's equation


ops = st.lists(
    st.tuples(
        st.sampled_from(["kv", "kv", "kv_free", "active", "active_free", "ckpt", "ckpt", "ckpt_free"]),
        st.integers(1, 900),
        st.integers(0, 10_000),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(0, 12), st.sampled_from([0, 0, 700, 5000]), st.sampled_from([0, 0, 3, 9]))
def test_random_sequences_never_overlap_or_leak(seq, reserve, min_kv, cap):
    led = BlockLedger(GEOM, active_reserve=reserve, min_kv_tokens=min_kv, max_checkpoints=cap)
    kv: set = set()
    active: set = set()
    ckpts: set = set()
    for op, n, pick in seq:
        free_before = led.free_blocks()
        if op == "kv":
            avail = led.kv_available()
            got = led.kv_alloc(n)
            assert (got is None) == (n > avail)
            if got is not None:
                assert len(got) == n and not (set(got) & kv) and len(set(got)) == n
                kv |= set(got)
        elif op == "kv_free" and kv:
            victims = sorted(kv)[pick % len(kv) :][:n]
            led.kv_free(victims)
            kv -= set(victims)
        elif op == "active":
            free = led.free_blocks()
            b = led.active_alloc()
            assert (b is None) == (free == 0)
            if b is not None:
                active.add(b)
        elif op == "active_free" and active:
            b = sorted(active)[pick % len(active)]
            led.active_free(b)
            active.discard(b)
        elif op == "ckpt":
            room = led.ckpt_has_room()
            h = led.ckpt_alloc()
            assert (h is None) == (not room)
            if h is not None:
                assert h not in ckpts
                ckpts.add(h)
                # a checkpoint never takes a block the KV floor needs, nor passes the cap
                assert led.ckpt_count() <= (cap or led.ckpt_count())
                if led.free_blocks() < free_before:
                    assert led.kv_capacity() >= min_kv
        elif op == "ckpt_free" and ckpts:
            h = sorted(ckpts)[pick % len(ckpts)]
            led.ckpt_free(h)
            ckpts.discard(h)
            # KV never takes the blocks held back for active slots
            assert led.free_blocks() >= min(free_before, led.reserve_left())
        _check(led, kv, active, ckpts)
    led.kv_free(sorted(kv))
    for b in list(active):
        led.active_free(b)
    for h in list(ckpts):
        led.ckpt_free(h)
    _check(led, set(), set(), set())
    assert led.free_blocks() == GEOM.usable_blocks
    assert led.largest_free_run() == GEOM.usable_blocks * GEOM.block_bytes


def test_kv_leaves_the_active_reserve_alone():
    led = BlockLedger(GEOM, active_reserve=5)
    per = GEOM.kv_per_block
    room = (GEOM.usable_blocks - 5) * per
    assert led.kv_available() == room
    assert led.kv_alloc(room + 1) is None
    assert led.kv_alloc(room) is not None
    assert led.kv_available() == 0 and led.free_blocks() == 5
    for _ in range(5):
        assert led.active_alloc() is not None
    assert led.active_alloc() is None


def test_kinds_grow_from_opposite_ends_and_pack():
    led = BlockLedger(GEOM, active_reserve=0)
    t = led.kv_alloc(1)[0]
    h0, h1 = led.ckpt_alloc(), led.ckpt_alloc()
    assert t // GEOM.kv_per_block == 1  # lowest usable block
    assert h0 // GEOM.ckpt_per_block == GEOM.num_blocks - 1  # highest block
    assert h1 // GEOM.ckpt_per_block == h0 // GEOM.ckpt_per_block  # packed into the same block
    assert led.kv_alloc(1)[0] // GEOM.kv_per_block == 1  # best fit: the partly used block first


def test_double_free_and_foreign_index_are_refused():
    led = BlockLedger(GEOM, active_reserve=0)
    t = led.kv_alloc(2)
    led.kv_free(t[:1])
    with pytest.raises(LedgerError):
        led.kv_free(t[:1])
    b = led.active_alloc()
    with pytest.raises(LedgerError):
        led.ckpt_free(b * GEOM.ckpt_per_block)
    with pytest.raises(LedgerError):
        led.active_free(t[1] // GEOM.kv_per_block)
    assert led.kind[b] == Kind.ACTIVE


def test_too_small_a_budget_is_refused_with_the_sizes():
    small = plan_geometry(2 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=150_000)
    with pytest.raises(LedgerError, match="needs at\\s+least 3"):
        BlockLedger(small, active_reserve=1)
