"""The k3 cache against SGLang's scheduler contract, on real SGLang objects (pools, ``Req``,
``RadixKey``) on the CPU, for paths a server test cannot provoke on demand."""

from __future__ import annotations

import pytest

from sglang_k3.config import K3Config

pytest.importorskip("sglang")


def _req(rid: str, ids: list[int]):
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=4))


def test_a_request_aborted_while_waiting_is_forgotten():
    """A waiting request is matched (``cow_mamba``) every time the prefill loop reaches it. If it is
    aborted before it runs, upstream's scheduler tells the cache only through
    ``finish(handle, ABORT)`` (``Scheduler._release_aborted_request``) and sets no finished reason,
    so the cache cannot learn it from the request: it must forget the request there."""
    from cpu_pools import k3_cache_on_cpu
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = k3_cache_on_cpu(K3Config())
    reqs = [_req(f"r{i}", list(range(i, i + 100))) for i in range(3)]
    for r in reqs:
        for _ in range(2):  # matched again on the next scheduler step: still one record
            cache.match_prefix(MatchPrefixParams(key=RadixKey(r.origin_input_ids), cow_mamba=True, req=r))
    assert cache.stats_dict()["tracked_requests"] == 3
    for r in reqs[:2]:
        cache.finish(r.cache_request_handle, CacheRequestOutcome.ABORT)
    assert not reqs[0].finished()  # nothing on the request says it is gone
    assert cache.stats_dict()["tracked_requests"] == 1
    cache.finish(reqs[2].cache_request_handle, CacheRequestOutcome.SUCCESS)  # not an abort: kept
    assert cache.stats_dict()["tracked_requests"] == 1


@pytest.fixture(scope="module")
def scheduler_context(embedded_model_dir):
    """SGLang's process config as a scheduler sees it (``PrefillAdder`` reads it), for the
    embedded model on the CPU; entered per test with ``use_context``, never published."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    return create_context(ServerArgs(model_path=embedded_model_dir, device="cpu"), role="test")


def _adder(cache, alloc):
    """SGLang's own ``PrefillAdder`` over the cache, as ``_get_new_batch_prefill_raw`` builds it
    for an idle server (no running batch, no chunking)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(
        page_size=1,
        tree_cache=cache,
        token_to_kv_pool_allocator=alloc,
        running_batch=ScheduleBatch(reqs=[]),
        new_token_ratio=1.0,
        rem_input_tokens=10_000,
        rem_chunk_tokens=None,
    )


@pytest.mark.parametrize("dtype", ["int8", "fp32"])
def test_a_matched_request_the_prefill_adder_refuses_gives_its_pin_back(dtype, scheduler_context):
    """The shape of the "Out of memory ... alloc_for_extend" crash seen under pressure: the adder
    admits request A against free + evictable memory, then matches B, whose hit pins a cached
    path, and refuses B for lack of room. B's pin must not outlive the refusal, or A's KV
    allocation, which counted on evicting that path, comes up short; B's queued restore must
    not stay queued either (SGLang freed the slot it would write). Driven through SGLang's own
    ``Req.init_next_round_input`` and ``PrefillAdder.add_one_req``, wrapped by the patch."""
    from cpu_pools import unified_k3_cache_on_cpu
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.runtime_context import use_context

    from sglang_k3.patches.prefill_adder_not_admitted import admit_within_state_slots

    def add(adder, req):  # the scheduler's call, through the patch's hook
        original = PrefillAdder.add_one_req
        return admit_within_state_slots(original, adder, req, has_chunked_req=False, truncation_align_size=None)

    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(checkpoint_dtype=dtype), kv_tokens=400, mamba_size=6, rows=4)
    path = list(range(1, 201))
    ins = cache.lifecycle.insert(path, alloc.alloc(len(path)).tolist())
    cache.tree.add_checkpoint(ins.node, 150, [cache.store.alloc()], cache.store.slot_bytes, ready=True)
    with use_context(scheduler_context):
        adder = _adder(cache, alloc)
        room = adder.rem_total_tokens  # free + evictable (the cached path)
        assert room > len(path) + 64
        # A: a miss that fits only if the cached path is evicted when its KV is allocated
        a_len = room - 8 - 4  # leaves 8 tokens beyond A's prompt and its 4 new tokens
        a = _req("a", list(range(1000, 1000 + a_len)))
        a.init_next_round_input(cache)
        assert add(adder, a) != AddReqResult.OTHER and adder.can_run_list == [a]
        after_a = adder.rem_total_tokens
        assert 0 <= after_a <= 8
        # B: hits the path at 150 (pinned at the match), then does not fit
        b = _req("b", path[:180] + list(range(5000, 5100)))
        b.init_next_round_input(cache)
        assert b.prefix_len == 150 and cache.lifecycle.requests["b"].pin is not None
        assert adder.rem_total_tokens < 0  # the pin took the path out of what eviction may free
        assert add(adder, b) == AddReqResult.NO_TOKEN and adder.can_run_list == [a]
        assert adder.rem_total_tokens == after_a  # as before B's match
    assert cache.lifecycle.requests["b"].pin is None and len(cache.fwd.restores) == 0
    assert cache.stats_dict()["matches_not_admitted"] == 1
    # A's KV, allocated as alloc_for_extend does: evict the shortfall, then allocate
    evict_from_tree_cache(cache, a_len)
    got = alloc.alloc(a_len)
    assert got is not None and len(got) == a_len


def test_the_prefill_adder_admits_no_request_without_a_state_slot_to_be_had(scheduler_context):
    """The shape of the "Not enough space for mamba cache" stop seen on an H100 under pressure:
    every region slot but one holds a running request's state, a checkpoint borrows the last one
    and cannot go (a hit being restored pins it), and KV fills every other block, with free tokens
    inside them but no whole free blocks. SGLang's adder counts rows and KV tokens, so it admits a
    miss, and ``alloc_req_slots`` then asserts. Through the patch the adder answers ``NO_TOKEN``
    (the request waits); once the pin is released the borrower goes for the slot and the same
    request is admitted and allocated. SGLang's own ``PrefillAdder`` and ``alloc_req_slots``."""
    from cpu_pools import unified_k3_cache_on_cpu
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.allocation import alloc_req_slots
    from sglang.srt.runtime_context import use_context

    from sglang_k3.patches.prefill_adder_not_admitted import admit_within_state_slots

    def add(adder, req):
        original = PrefillAdder.add_one_req
        return admit_within_state_slots(original, adder, req, has_chunked_req=False, truncation_align_size=None)

    cache, _, alloc = unified_k3_cache_on_cpu(K3Config(), kv_tokens=400, mamba_size=6, rows=4)
    led, rtp = cache.ledger, cache.req_to_token_pool
    running = [rtp.mamba_allocator.alloc(1) for _ in range(led.active_reserve - 1)]
    kv = alloc.alloc(alloc.available_size())  # every block outside the region is KV now
    ins = cache.lifecycle.insert(list(range(1, 11)), kv[:10].tolist())
    ck = cache.tree.add_checkpoint(ins.node, 10, [cache.store.alloc()], cache.store.slot_bytes, ready=True)
    alloc.free(kv[10::2])  # free tokens in every KV block, no whole free block
    assert alloc.available_size() > 100 and led.free_slots() == 0
    pin = cache.tree.pin_hit(ck)  # the borrower of the last region slot cannot go
    with use_context(scheduler_context):
        u = _req("u", list(range(1000, 1040)))
        u.init_next_round_input(cache)
        assert not u.kv.holds_mamba
        unguarded = _adder(cache, alloc)
        assert unguarded.add_one_req(u, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
        with pytest.raises(AssertionError, match="Not enough space for mamba cache"):
            alloc_req_slots(rtp, unguarded.can_run_list, cache)  # what the server did
        a = _req("a", list(range(1000, 1040)))  # the same prompt, through the patch
        a.init_next_round_input(cache)
        adder = _adder(cache, alloc)
        assert add(adder, a) == AddReqResult.NO_TOKEN and adder.can_run_list == []
        assert cache.stats_dict()["state_slot_refusals"] == 1
        cache.tree.release_pin(pin)
        adder = _adder(cache, alloc)
        assert add(adder, a) == AddReqResult.CONTINUE and adder.can_run_list == [a]
        rows = alloc_req_slots(rtp, adder.can_run_list, cache)
        assert len(rows) == 1 and a.kv.holds_mamba
    led.check()
    assert len(running) == led.active_reserve - 1 and led.active_count() == led.active_reserve


def test_scheduler_verbs_are_found_on_the_k3_cache_only():
    """The patches reach the cache only through ``verbs_of``: the k3 cache's verbs, None for
    anything else (SGLang's own cache, a disabled one), so every patch is a no-op there. The verbs
    hand each moment to the cache: a refused match drops its pin, an empty queue ends the wants,
    the snapshot is what ``/server_info`` shows."""
    from cpu_pools import k3_cache_on_cpu
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_k3.integration.scheduler_verbs import SchedulerVerbs, verbs_of

    cache = k3_cache_on_cpu(K3Config())
    verbs = verbs_of(cache)
    assert isinstance(verbs, SchedulerVerbs) and verbs.cache is cache
    assert verbs_of(None) is None and verbs_of(object()) is None

    req = _req("v1", list(range(200)))
    before = verbs.lookups()
    cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), cow_mamba=True, req=req))
    assert verbs.lookups() == before + 1
    verbs.not_admitted(req)
    snap = verbs.snapshot()
    assert snap["matches_not_admitted"] == 1 and snap["checkpoint_dtype"] == "int8"
    assert {"tier_saves", "memory_budget_bytes", "tracked_requests"} <= set(snap)

    cache.tree._wanted_since = 0  # as after a refresh: every touched checkpoint is wanted
    verbs.waiting_queue_empty()
    assert cache.tree._wanted_since == 1 << 62
    with verbs.eviction_refresh():
        assert cache.eviction_refresh is True
    assert cache.eviction_refresh is False
