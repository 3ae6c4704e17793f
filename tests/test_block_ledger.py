"""The unified budget's block ledger: random allocate/free sequences of all three kinds never give
two live allocations overlapping bytes, never leak, and account every byte to exactly one kind;
after everything is freed, every usable byte is free in one run. At every KV page size k3 serves
(SGLang's ``--page-size``), KV moves in whole pages and a page never straddles two blocks."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_k3.cache.block_ledger import BlockLedger, Kind, LedgerError, plan_geometry

# the embedded model's sizes: MLA KV 1,280 B/token, an fp32 KDA state 420,864 B, an int8
# checkpoint about a third of it: a block holds one checkpoint, a state spans three blocks
GEOM = plan_geometry(40 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=150_000)
SPAN = GEOM.active_span
PAGES = (1, 16, 64, 256)
GEOMS = {
    p: plan_geometry(40 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=150_000, kv_page=p)
    for p in PAGES
}


@pytest.mark.parametrize("page", PAGES)
def test_a_block_holds_whole_pages(page):
    g = GEOMS[page]
    assert g.kv_per_block % page == 0 and g.pages_per_block >= 1
    assert g.ckpt_per_block * g.ckpt_stride == g.block_bytes and g.ckpt_stride >= g.ckpt_bytes
    assert g.active_span * g.block_bytes >= g.active_bytes
    if page == 1:
        assert g == GEOM  # page 1 cuts the budget as before pages existed


def test_blocks_are_sized_for_a_checkpoint_and_a_state_spans_several():
    assert (GEOM.ckpt_per_block, SPAN) == (1, 3)
    assert GEOM.ckpt_bytes <= GEOM.block_bytes < GEOM.ckpt_bytes + 1280 + 64
    assert (SPAN - 1) * GEOM.block_bytes < GEOM.active_bytes <= SPAN * GEOM.block_bytes
    fp32 = plan_geometry(40 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=420_864)
    assert fp32.active_span == 1 and fp32.ckpt_per_block == 1  # fp32 checkpoints: one state per block


def _intervals(led: BlockLedger, kv: set, active: set, ckpts: set) -> list[tuple[int, int, str]]:
    g, span = led.geom, led.span
    out = [(t * g.kv_token_bytes, (t + 1) * g.kv_token_bytes, "kv") for t in kv]
    out += [(s * span * g.block_bytes, s * span * g.block_bytes + g.active_bytes, "active") for s in active]
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
        assert g.reserved_blocks * g.block_bytes <= s and e <= g.budget_bytes  # never in the padding target
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
    assert split["active_bytes"] == len(active) * led.span * g.block_bytes
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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops,
    st.integers(0, 12),
    st.sampled_from([0, 0, 700, 5000]),
    st.sampled_from([0, 0, 3, 9]),
    st.sampled_from(PAGES),
)
def test_random_sequences_never_overlap_or_leak(seq, reserve, min_kv, cap, page):
    g = GEOMS[page]
    led = BlockLedger(g, active_reserve=reserve, min_kv_tokens=min_kv, max_checkpoints=cap)
    span = led.span
    kv: set = set()
    active: set = set()
    ckpts: set = set()
    for op, n, pick in seq:
        free_before = led.free_blocks()
        if op == "kv":
            n = -(-n // page) * page  # SGLang asks for whole pages
            avail = led.kv_available()
            got = led.kv_alloc(n)
            assert (got is None) == (n > avail)
            if got is not None:
                assert len(got) == n and not (set(got) & kv) and len(set(got)) == n
                for i in range(0, n, page):  # each page: whole, aligned, in one block
                    run = got[i : i + page]
                    assert run == list(range(run[0], run[0] + page)) and run[0] % page == 0
                    assert run[0] // g.kv_per_block == run[-1] // g.kv_per_block
                kv |= set(got)
        elif op == "kv_free" and kv:
            pages = sorted({t // page for t in kv})
            victims = pages[pick % len(pages) :][: max(1, n // page)]
            # SGLang's paged allocator frees the pages of whatever tokens it is given: sometimes
            # every token of a page, sometimes one
            given_ = [q * page + (i if pick % 2 else 0) for q in victims for i in range(page if pick % 2 else 1)]
            led.kv_free(given_)
            kv -= {q * page + i for q in victims for i in range(page)}
        elif op == "active":
            free = led.free_slots()
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
        # KV never takes the active region: the slots no state holds are free or borrowed
        region = [s for s in led.region_slots if s not in active]
        assert all(led.kind[b] in (Kind.FREE, Kind.CKPT) for s in region for b in range(s * span, (s + 1) * span))
        _check(led, kv, active, ckpts)
    led.kv_free(sorted(kv))
    for b in list(active):
        led.active_free(b)
    for h in list(ckpts):
        led.ckpt_free(h)
    _check(led, set(), set(), set())
    assert led.free_blocks() == g.usable_blocks
    assert led.largest_free_run() == g.usable_blocks * g.block_bytes  # after a flush: one run


@pytest.mark.parametrize("page", [16, 64])
def test_paged_kv_refuses_part_pages_and_double_frees(page):
    led = BlockLedger(GEOMS[page], active_reserve=2)
    with pytest.raises(LedgerError, match="whole pages"):
        led.kv_alloc(page + 1)
    got = led.kv_alloc(2 * page)
    led.kv_free(got[page + 3 : page + 4])  # one token frees its page, as in SGLang's paged allocator
    assert led.kv_free_tokens() == GEOMS[page].kv_per_block - page
    with pytest.raises(LedgerError, match="not allocated"):
        led.kv_free(got[page:])
    led.kv_free(got[:1])
    assert led.kv_free_tokens() == 0 and led.free_blocks() == GEOMS[page].usable_blocks


def test_kv_leaves_the_active_reserve_alone():
    led = BlockLedger(GEOM, active_reserve=5)
    per = GEOM.kv_per_block
    room = (GEOM.usable_blocks - 5 * SPAN) * per
    assert led.kv_available() == room
    assert led.kv_alloc(room + 1) is None
    assert led.kv_alloc(room) is not None
    assert led.kv_available() == 0 and led.free_blocks() == 5 * SPAN and led.free_slots() == 5
    for _ in range(5):
        assert led.active_alloc() is not None
    assert led.active_alloc() is None


def test_checkpoints_borrow_the_active_region_and_a_slot_names_them_to_evict():
    led = BlockLedger(GEOM, active_reserve=2)
    assert led.kv_alloc(led.kv_available()) is not None  # KV takes everything outside the region
    hs = [led.ckpt_alloc() for _ in range(2 * SPAN)]  # checkpoints fill the region's blocks
    assert None not in hs and led.ckpt_alloc() is None
    assert led.free_slots() == 0 and led.active_alloc() is None
    victims = led.active_victims()
    assert [len(v) for v in victims] == [SPAN, SPAN] and sorted(sum(victims, [])) == sorted(hs)
    for h in victims[0]:
        led.ckpt_free(h)
    s = led.active_alloc()
    assert s is not None and [led.kind[b] for b in range(s * SPAN, (s + 1) * SPAN)] == [Kind.ACTIVE] * SPAN
    assert led.active_victims() == [victims[1]]
    led.check()


def test_a_state_falls_back_to_a_free_run_outside_the_region():
    """The region's only slot is borrowed by a checkpoint that cannot go (a hit being restored
    from it is pinned): a state still gets an aligned run of free blocks elsewhere."""
    led = BlockLedger(GEOM, active_reserve=1)
    hs = [led.ckpt_alloc() for _ in range(led.free_blocks())]
    region = led.region_slots[0]
    for h in hs:
        if h // GEOM.ckpt_per_block // SPAN not in (region, 5):  # free all but the region and slot 5
            led.ckpt_free(h)
    assert led.free_slots() > 0
    s = led.active_alloc()
    assert s is not None and s != region
    assert all(led.kind[b] == Kind.ACTIVE for b in range(s * SPAN, (s + 1) * SPAN))
    led.active_free(s)
    led.check()


def test_kinds_grow_from_opposite_ends_and_pack():
    led = BlockLedger(GEOM, active_reserve=0)
    t = led.kv_alloc(1)[0]
    h0, h1 = led.ckpt_alloc(), led.ckpt_alloc()
    assert t // GEOM.kv_per_block == GEOM.reserved_blocks  # lowest usable block
    assert h0 // GEOM.ckpt_per_block == GEOM.num_blocks - 1  # highest block
    assert h1 // GEOM.ckpt_per_block == GEOM.num_blocks - 2  # one checkpoint per block: the next one down
    assert led.kv_alloc(1)[0] // GEOM.kv_per_block == GEOM.reserved_blocks  # best fit: the partly used block first


def test_double_free_and_foreign_index_are_refused():
    led = BlockLedger(GEOM, active_reserve=0)
    t = led.kv_alloc(2)
    led.kv_free(t[:1])
    with pytest.raises(LedgerError):
        led.kv_free(t[:1])
    led2 = BlockLedger(GEOM, active_reserve=1)
    b = led2.active_alloc()
    with pytest.raises(LedgerError):
        led2.ckpt_free(b * SPAN * GEOM.ckpt_per_block)
    with pytest.raises(LedgerError):
        led2.active_free(b + 1)
    assert led2.kind[b * SPAN] == Kind.ACTIVE


def test_too_small_a_budget_is_refused_with_the_sizes():
    small = plan_geometry(2 * 420_864, kv_token_bytes=1280, active_bytes=420_864, ckpt_bytes=150_000)
    with pytest.raises(LedgerError, match="needs at\\s+least 7"):
        BlockLedger(small, active_reserve=1)
