"""The unified budget on real SGLang pools (CPU), as the server installs it: the views of the three
kinds never overlap in memory, checkpoints round-trip through the shared buffer, a shortage of
one kind is met by evicting the other, SGLang's leak-check equations hold, and a budget or floors
that cannot work are refused with the sizes."""

import random

import pytest
import torch
from cpu_pools import hybrid_pool, mla_kv_pool_and_allocator, unified_k3_cache_on_cpu

from sglang_k3.config import K3Config
from sglang_k3.integration.unified_memory import UnifiedConfigError, plan


def _pools(cache):
    rtp = cache.req_to_token_pool
    return rtp, rtp.mamba_pool.mamba_cache


@pytest.mark.parametrize("seed", [3, 4])
def test_live_allocations_of_all_kinds_never_share_bytes(seed):
    """Write a distinct value through every live KV token, state slot and checkpoint, through
    the very views SGLang and the checkpoint pool use; every one reads back its own value."""
    rng = random.Random(seed)
    cache, kv, alloc = unified_k3_cache_on_cpu(K3Config(checkpoint_dtype="fp32"), kv_tokens=160, mamba_size=8)
    rtp, mc = _pools(cache)
    buf = kv.full_kv_pool.kv_buffer[0]
    tokens, slots, handles = [], [], []
    tag = 1.0
    marks = {}
    for _ in range(40):
        op = rng.choice(["kv", "kv", "slot", "ckpt", "free_kv"])
        if op == "kv":
            got = alloc.alloc(rng.randint(1, 30))
            if got is not None:
                tokens += got.tolist()
        elif op == "slot":
            got = rtp.mamba_allocator.alloc(1)
            if got is not None:
                slots.append(int(got[0]))
        elif op == "ckpt":
            h = cache.store.alloc()
            if h is not None:
                handles.append(h)
        elif op == "free_kv" and tokens:
            alloc.free(torch.tensor(tokens[:5]))
            tokens = tokens[5:]
    for t in tokens:
        buf[t] = tag
        marks[("kv", t)] = tag
        tag += 1
    q = cache.store.pool.q
    for s in slots:
        mc.temporal[:, s] = tag
        mc.conv[0][:, s] = tag
        marks[("slot", s)] = tag
        tag += 1
    for h in handles:
        q[h] = tag
        cache.store.pool.conv[h] = tag
        marks[("ckpt", h)] = tag
        tag += 1
    for (kind, i), v in marks.items():
        if kind == "kv":
            assert torch.all(buf[i] == v), (kind, i)
        elif kind == "slot":
            assert torch.all(mc.temporal[:, i] == v) and torch.all(mc.conv[0][:, i] == v), (kind, i)
        else:
            assert torch.all(q[i] == v) and torch.all(cache.store.pool.conv[i] == v), (kind, i)
    assert len(marks) > 10
    cache.ledger.check()


def test_checkpoints_round_trip_through_the_shared_buffer():
    """fp32 checkpoints in the unified buffer are bit-exact; the active slot's state is restored."""
    cache, _, _ = unified_k3_cache_on_cpu(K3Config(checkpoint_dtype="fp32"))
    rtp, mc = _pools(cache)
    a, b = (int(rtp.mamba_allocator.alloc(1)[0]) for _ in range(2))
    torch.manual_seed(0)
    mc.temporal[:, a] = torch.randn_like(mc.temporal[:, a])
    mc.conv[0][:, a] = torch.randn_like(mc.conv[0][:, a])
    h = cache.store.capture_active(a)
    assert h is not None
    cache.store.pool.restore([h], [b])
    assert torch.equal(mc.temporal[:, a], mc.temporal[:, b]) and torch.equal(mc.conv[0][:, a], mc.conv[0][:, b])


def _fill_with_checkpoints(cache, alloc, length=200):
    """One cached path of ``length`` tokens with a checkpoint at every position, until the
    budget has no room for another: every free block ends up holding checkpoints."""
    tree, led = cache.tree, cache.ledger
    ins = cache.lifecycle.insert(list(range(1, length + 1)), alloc.alloc(length).tolist())
    for pos in range(1, length + 1):
        if not led.ckpt_has_room():
            break
        h = cache.store.alloc()
        tree.add_checkpoint(ins.node, pos, [h], cache.store.slot_bytes, ready=True)
    assert not led.ckpt_has_room() and led.free_blocks() == 0
    return ins.node


def test_a_state_slot_shortage_evicts_checkpoints_and_the_leak_equations_hold():
    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    rtp, _ = _pools(cache)
    led = cache.ledger
    _fill_with_checkpoints(cache, alloc)
    before = led.ckpt_count()
    got = rtp.mamba_allocator.alloc(1)  # the slot allocator evicts the checkpoints that borrowed a slot
    assert got is not None and led.ckpt_count() < before
    g = led.geom
    assert led.ckpt_count() >= before - g.active_span * g.ckpt_per_block  # one slot's worth, not all
    evicted = (before - led.ckpt_count()) * cache.store.slot_bytes
    assert led.counters.reclaims == 1 and led.counters.reclaim_evicted_bytes >= evicted
    # SGLang's idle equations (invariant_checker._check_all_pools), with the slot given back
    rtp.mamba_allocator.free(got)
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == alloc.size
    assert rtp.mamba_allocator.available_size() + cache.mamba_evictable_size() + cache.mamba_protected_size() == (
        rtp.mamba_pool.size
    )
    # a flush: the cache drops the tree, SGLang clears both allocators; every usable byte is free
    cache.reset()
    rtp.clear()
    alloc.clear()
    assert led.free_blocks() == g.usable_blocks and led.largest_free_run() == g.usable_blocks * g.block_bytes


def test_a_kv_shortage_evicts_checkpoints_into_kv_blocks():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    led = cache.ledger
    node = _fill_with_checkpoints(cache, alloc)
    cache.tree.inc_lock_ref(node)  # a running request holds the path's KV: only checkpoints can go
    ckpt_blocks = led.bytes_by_kind()["checkpoint_bytes"]
    want = led.kv_available() + led.geom.kv_per_block
    assert alloc.available_size() >= want  # SGLang is told eviction can make this room
    cache.evict(EvictParams(num_tokens=want - led.kv_available()))
    assert led.kv_available() >= want
    assert led.bytes_by_kind()["checkpoint_bytes"] < ckpt_blocks
    assert cache.tree.total_size() == 200  # the locked KV stayed


def test_budgets_and_floors_that_cannot_work_are_refused_with_the_sizes():
    cache, kv, _ = unified_k3_cache_on_cpu(K3Config(), kv_tokens=96, mamba_size=6)
    rtp = cache.req_to_token_pool
    with pytest.raises(UnifiedConfigError, match="--k3-min-kv-tokens 100000"):
        plan(K3Config(min_kv_tokens=100_000), kv.full_kv_pool, rtp.mamba_pool, max_running=4)
    with pytest.raises(UnifiedConfigError, match="--k3-min-checkpoints 500"):
        plan(K3Config(min_checkpoints=500), kv.full_kv_pool, rtp.mamba_pool, max_running=4)
    # SGLang sized 8 KV tokens and one state slot: not even one state slot and one KV block
    with pytest.raises(UnifiedConfigError, match=r"holds \d+ blocks .* needs \d+ \(the padding target \(\d+ blocks\)"):
        unified_k3_cache_on_cpu(K3Config(), kv_tokens=8, mamba_size=1)


def test_a_budget_full_of_checkpoints_still_admits_kv():
    """SGLang admits a prefill only if the KV allocator's available size (plus the tree's
    evictable KV) covers it: checkpoint blocks that eviction would free count as available, and
    allocating them evicts the checkpoints, so a budget full of checkpoints never looks full."""
    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    led = cache.ledger
    node = _fill_with_checkpoints(cache, alloc)
    cache.tree.inc_lock_ref(node)  # its KV is in use: only checkpoints can make room
    assert led.kv_available() < led.geom.kv_per_block  # the ledger alone: no room for a block of KV
    want = alloc.available_size()
    assert want >= led.geom.kv_per_block  # but SGLang is told what eviction would give
    got = alloc.alloc(want)
    assert got is not None and len(got) == want
    assert alloc.available_size() == 0
    alloc.free(got)
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == alloc.size


def test_sglangs_eviction_then_allocation_succeeds_when_available_counts_checkpoints():
    """SGLang's path for a prefill of ``n`` tokens: shortfall = n - available_size() (which
    counts reclaimable checkpoint blocks), evict(num_tokens=shortfall), then alloc(n): alloc
    must then succeed, or SGLang raises out of memory with the request already admitted."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    _fill_with_checkpoints(cache, alloc)  # an unlocked path: its KV is evictable too
    n = alloc.available_size() + cache.evictable_size() // 2
    assert n > cache.ledger.kv_available()
    cache.evict(EvictParams(num_tokens=n - alloc.available_size()))
    got = alloc.alloc(n)
    assert got is not None and len(got) == n


def test_more_live_states_than_the_reserve_take_free_memory_never_live_data():
    """SGLang counts request slots as the active reserve; if more states are live at once (seen
    once under the overlap scheduler), the next slot comes from free blocks outside the reserve,
    counted, and is refused only when no free memory is left: nothing live is overwritten."""
    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    rtp, _ = _pools(cache)
    led = cache.ledger
    slots = rtp.mamba_allocator
    held = [slots.alloc(1) for _ in range(led.active_reserve)]
    assert all(h is not None for h in held) and slots.available_size() == 0
    extra = slots.alloc(1)
    assert extra is not None and led.counters.active_overflows == 1
    assert int(extra) not in {int(h) for h in held}
    led.check()
    # fill what is left with KV: then no slot can be had without evicting live data
    kv = alloc.alloc(alloc.available_size())
    assert kv is not None
    assert slots.alloc(1) is None and led.counters.active_overflows == 1
    led.check()
    for h in [*held, extra]:
        slots.free(h.reshape(-1))
    alloc.free(kv)
    assert slots.available_size() == led.active_reserve


def test_the_active_reserve_is_sglangs_rows_within_its_state_pool():
    """A request holds a state only while it holds a row, under the overlap scheduler too
    (``docs/sglang_cache_contract.md`` §6): the reserve is one slot per row, never more than the
    state pool SGLang sized."""
    cache, kv, _ = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6)
    pool = cache.req_to_token_pool.mamba_pool
    size = int(pool.size)
    assert plan(K3Config(), kv.full_kv_pool, pool, max_running=2)[0].active_reserve == min(size, 2)
    assert plan(K3Config(), kv.full_kv_pool, pool, max_running=100)[0].active_reserve == size


def test_install_drops_what_the_state_pool_cached_from_its_old_tensors():
    """SGLang's ``MambaPool`` caches, from the tensors it built, whether its fused conv-slot kernels
    may run and their pointer table (``functools.cached_property``, computed in its constructor on
    CUDA). The swap to unified views must drop those values, or every slot clear writes at the
    freed tensor's address (on the H200: an illegal memory access at the first request). Here the
    flag is computed on the CPU pool before the swap, as the GPU constructor does."""
    import functools

    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    from sglang_k3.integration.unified_memory import install

    cached = [n for n, a in vars(MambaPool).items() if isinstance(a, functools.cached_property)]
    assert "_conv_fuse_ok" in cached and "_conv_slot_desc" in cached  # what upstream 0.5.23 caches
    rtp = hybrid_pool([0, 2, 3], heads=2, head_dim=16, conv_kernel=4, mamba_size=6, size=4)
    pool = rtp.mamba_pool
    old_conv = pool.mamba_cache.conv[0]
    assert pool._conv_fuse_ok is False  # CPU: computed (and cached) from the old tensors
    pool.__dict__["_conv_slot_desc"] = ("descriptor of", old_conv.data_ptr())  # as the CUDA warm-up leaves it
    kv = HybridLinearKVPool(
        size=400,
        dtype=torch.float32,
        page_size=1,
        head_num=1,
        head_dim=48,
        full_attention_layer_ids=[1],
        device="cpu",
        mamba_pool=pool,
        use_mla=True,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
    )
    alloc = TokenToKVPoolAllocator(size=400, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    assert install(K3Config(), rtp, kv, alloc) is not None
    assert pool.mamba_cache.conv[0].data_ptr() != old_conv.data_ptr()
    assert not any(n in pool.__dict__ for n in cached)  # recomputed from the views on next use
    # and SGLang's clear runs on the views, zeroing exactly the slot asked for
    conv = pool.mamba_cache.conv[0]
    conv.fill_(1.0)
    pool.clear_slots(torch.tensor([1]))
    assert conv[:, 1].abs().sum() == 0 and conv[:, 0].abs().sum() > 0


def _paged_step(alloc, kind: str, prefix: list[int], seq: list[int], last_loc: list[int]):
    """One of SGLang's paged allocations for a batch, with its CPU tensors as the scheduler
    builds them (``alloc_extend`` for a prefill, ``alloc_decode`` for one token each)."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    if kind == "decode":
        return alloc.alloc_decode(t(seq), t(seq), t(last_loc))
    n = sum(s - p for p, s in zip(prefix, seq))
    return alloc.alloc_extend(t(prefix), t(prefix), t(seq), t(seq), t(last_loc), n)


@pytest.mark.parametrize("page, seed", [(16, 5), (64, 6)])
def test_the_paged_allocator_places_tokens_as_sglangs_own(page, seed):
    """Differential: the same batches of prefills (some continuing inside a page) and decodes go to
    SGLang's own paged allocator and to the unified one. Every token lands at the same offset in
    its page as SGLang's places it, a request's tokens of one page share that page, no page is
    handed out twice, and after every request is freed the ledger has all its KV back."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    rng = random.Random(seed)
    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=40 * page, mamba_size=6, rows=4, page=page)
    ref = PagedTokenToKVPoolAllocator(
        size=40 * page, page_size=page, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
    )
    led = cache.ledger
    capacity = led.kv_capacity()
    rows = {a: [[] for _ in range(3)] for a in ("k3", "ref")}  # request -> its KV indices
    for step in range(12):
        kind = "decode" if step % 3 == 2 else "extend"
        seq = [len(r) + (1 if kind == "decode" else rng.randint(1, 3 * page)) for r in rows["k3"]]
        for name, a in (("k3", alloc), ("ref", ref)):
            prefix = [len(r) for r in rows[name]]
            last = [r[-1] if r else -1 for r in rows[name]]
            out = _paged_step(a, kind, prefix, seq, last)
            assert out is not None, (name, step)
            i = 0
            for r, p, s in zip(rows[name], prefix, seq):
                r.extend(out[i : i + s - p].tolist())
                i += s - p
        for mine, theirs in zip(rows["k3"], rows["ref"]):
            assert [t % page for t in mine] == [t % page for t in theirs]
            for pos in range(1, len(mine)):
                same_page = pos % page != 0
                assert (mine[pos] // page == mine[pos - 1] // page) == same_page
        pages = [t // page for r in rows["k3"] for t in r[::page]]
        assert len(pages) == len(set(pages)) and 0 not in pages  # page 0 is the padding target
        led.check()
    used = sum(-(-len(r) // page) for r in rows["k3"])
    assert led.kv_capacity() - led.kv_available() == used * page
    for r in rows["k3"]:
        alloc.free(torch.tensor(r))
    assert led.kv_available() == led.kv_capacity() == capacity and led.free_blocks() == led.geom.usable_blocks


def test_the_paged_allocator_evicts_checkpoints_for_pages():
    """A budget full of checkpoints: a paged prefill still gets its pages, by evicting them."""
    page = 16
    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4, page=page)
    led = cache.ledger
    node = _fill_with_checkpoints(cache, alloc, length=192)
    cache.tree.inc_lock_ref(node)  # the path's KV is in use: only checkpoints can go
    want = led.kv_available() + 2 * led.geom.kv_per_block
    assert alloc.available_size() >= want
    out = _paged_step(alloc, "extend", [0], [want], [-1])
    assert out is not None and len(out) == want and led.counters.reclaims >= 1
    assert [int(t) % page for t in out[:page]] == list(range(page))
    led.check()


def test_a_hit_whose_checkpoint_holds_the_last_state_slot_is_retaken_not_a_crash():
    """The live tier A/B's Mooncake server stopped on "no KDA state slot free for a cache hit":
    SGLang's count left one state slot free, but its blocks were borrowed by checkpoints, one of
    them the very checkpoint the hit restores from (pinned by the match), and every other block
    held KV in use. Here: one request row, KV in use everywhere outside the active region, and the
    region's blocks full of checkpoints on that path. The hit lets go, the request takes the slot,
    and it is matched again holding it (a miss here: its checkpoints had to go)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=1)
    led = cache.ledger
    assert led.active_reserve == 1
    n = led.kv_available()
    path = list(range(1, n + 1))
    ins = cache.lifecycle.insert(path, alloc.alloc(n).tolist())
    cache.tree.inc_lock_ref(ins.node)  # its KV is in use (a running request's): it cannot go
    pos = n
    while led.ckpt_has_room():  # checkpoints fill the region, the only blocks left
        cache.tree.add_checkpoint(ins.node, pos, [cache.store.alloc()], cache.store.slot_bytes, ready=True)
        pos -= 1
    assert led.free_blocks() == 0 and led.free_slots() == 0 and cache.tree.checkpoint_count() > 0
    req = Req("hit", "", array("q", path + [7, 7, 7]), SamplingParams(max_new_tokens=4))
    out = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), cow_mamba=True, req=req))
    assert cache.hits_retaken_for_slot == 1
    assert req.kv.holds_mamba and led.active_count() == 1  # the request holds the region's slot
    assert out.device_prefix_len == 0 and req.kv.mamba_needs_clear  # its checkpoints went: a fresh state
    assert cache.mamba_protected_size() == 0  # no pin is left behind
    led.check()


@pytest.mark.parametrize("page", [1, 16])
def test_the_pd_transfer_reads_every_layers_kv_and_the_whole_state_from_one_region(page):
    """A PD server keeps unified memory: SGLang's transfer setup (``get_kv_transfer_buf_infos``,
    ``build_kv_layer_ids``, ``setup_state_kv_args``: what a prefill and a decode server run to
    describe their pools to Mooncake) sees one region, the whole buffer, registered once
    (``MooncakeKVManager._registerable_regions``), and addresses KV page ``p`` at
    ``ptr + p * item_len`` and state slot ``s`` at ``ptr + s * item_len`` (``_send_mamba_state``).
    Those bytes are every MLA layer's rows of the page's tokens and every KDA layer's recurrent and
    conv state of the slot, as the views hold them. SGLang's own per-layer description of the same
    views gave overlapping regions (Mooncake refused them: every transfer failed)."""
    import types

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import build_kv_layer_ids, get_kv_transfer_buf_infos, setup_state_kv_args

    from sglang_k3.integration.unified_memory import install
    from sglang_k3.state.unified_buffer import StateLayout

    rtp = hybrid_pool([0, 2, 3], heads=2, head_dim=16, conv_kernel=4, mamba_size=6, size=4)
    kv, alloc = mla_kv_pool_and_allocator(rtp, kv_tokens=256, page=page, mla_layers=(1, 4))
    assert install(K3Config(), rtp, kv, alloc) is not None
    views = kv.full_kv_pool.kv_buffer
    cache = rtp.mamba_pool.mamba_cache
    g = torch.Generator().manual_seed(page)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g))
    cache.temporal.copy_(torch.randn(cache.temporal.shape, generator=g))
    cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=g))

    args = types.SimpleNamespace(
        aux_data_ptrs=[], aux_data_lens=[], state_types=[], state_data_ptrs=[], state_data_lens=[],
        state_item_lens=[], state_dim_per_tensor=[], state_conv_shard_groups=[], state_slice_outer_counts=[],
        state_layer_ids=[],
    )  # fmt: skip
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(kv)
    args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=kv, draft_token_to_kv_pool=None, num_draft_entries=0, num_hidden_layers=5
    )
    setup_state_kv_args(args, kv, req_to_token_pool=rtp)
    assert len(args.kv_data_ptrs) == len(args.kv_layer_ids) == 1
    assert [len(p) for p in args.state_data_ptrs] == [1] and args.state_layer_ids == [[]]
    regions = MooncakeKVManager._registerable_regions(types.SimpleNamespace(kv_args=args))
    raw = rtp._k3_unified_memory.buffer.raw
    assert regions == [(raw.data_ptr(), raw.numel())]

    def at(ptr: int, item: int, index: int) -> torch.Tensor:
        off = ptr + index * item - raw.data_ptr()
        assert off >= 0 and off + item <= raw.numel()
        return raw[off : off + item]

    kv_item = args.kv_item_lens[0]
    for p in (0, 3, (views[0].shape[0] // page) - 2):
        got = at(args.kv_data_ptrs[0], kv_item, p).view(torch.float32).reshape(page, len(views), -1)
        for layer, v in enumerate(views):
            assert torch.equal(got[:, layer], v[p * page : (p + 1) * page, 0]), (p, layer)
    st_item = args.state_item_lens[0][0]
    layout = StateLayout.of_mamba_cache(cache)  # conv follows the recurrent state in the slot
    for s in range(cache.temporal.shape[1]):
        got = at(args.state_data_ptrs[0][0], st_item, s)
        t, c = cache.temporal[:, s], cache.conv[0][:, s]
        assert torch.equal(got[: t.numel() * t.element_size()].view(t.dtype), t.reshape(-1)), s
        conv = got[layout.conv_offset : layout.conv_offset + c.numel() * c.element_size()]
        assert torch.equal(conv.view(c.dtype), c.reshape(-1)), s
