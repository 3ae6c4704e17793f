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

    return Req(rid, "", array("l", ids), SamplingParams(max_new_tokens=4))


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
