"""Behaviour of the ``k3`` cache through the real server, and the A/B hit rate against upstream."""

from __future__ import annotations

import random

from server_utils import abort_all_mid_flight, k3_state
from workloads import random_tokens, run_conversations


def _flush(s):
    s.flush_cache()  # retried: SGLang refuses while the last request is being retired


def test_fully_contained_prompt_still_hits(server_factory):
    """Upstream's known failure: a prompt entirely in the cache gets 0. Here the state exported
    at the last 64-token boundary before the prompt end is kept, so it hits there."""
    s = server_factory("k3_int8")
    _flush(s)
    ids = random_tokens(random.Random(11), 150)
    first = s.generate(ids, 5)
    again = s.generate(ids, 5)
    assert again["meta_info"]["cached_tokens"] == 128
    assert again["output_ids"] == first["output_ids"]
    shorter = s.generate(ids[:140], 5)  # contained in the cached path, ends mid-chunk
    assert shorter["meta_info"]["cached_tokens"] == 128


def test_branch_point_is_checkpointed(server_factory):
    """Two requests share a 100-token prefix; the second one's prefill keeps the state at the
    last chunk boundary before the branch, so a third sibling hits there."""
    s = server_factory("k3_int8")
    _flush(s)
    rng = random.Random(12)
    shared = random_tokens(rng, 100)
    a = s.generate(shared + random_tokens(rng, 50), 3)
    b = s.generate(shared + random_tokens(rng, 50), 3)
    assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] == 0
    c = s.generate(shared + random_tokens(rng, 50), 3)
    assert c["meta_info"]["cached_tokens"] == 64


def _hit_rate(records) -> float:
    return sum(r["cached_tokens"] for r in records) / sum(r["prompt_len"] for r in records)


def test_ab_hit_rate_k3_at_least_upstream(server_factory):
    """Multi-turn conversations whose turns extend the previous turn, same workload on both."""
    k3, up = server_factory("k3_int8"), server_factory("upstream")
    _flush(k3)
    _flush(up)
    rates = {}
    for name, s in (("k3", k3), ("upstream", up)):
        records = run_conversations(s, seed=31, n_conv=3, n_turns=4)
        rates[name] = _hit_rate(records)
    print(f"\nA/B token hit rate: k3 {rates['k3']:.3f} upstream {rates['upstream']:.3f}")
    assert rates["k3"] >= rates["upstream"]
    assert rates["k3"] > 0.3


def test_export_stash_keeps_only_candidate_rows(server_factory):
    """After an extend, the export stash holds one chunk-boundary row per KDA layer per candidate
    (prompt end; branch point), not the forward's full exported states. On the fp32 server a
    row of every KDA layer is exactly one fp32 checkpoint (fp32 states, conv rows in the pool's
    dtype), so the bound reads in checkpoint units."""
    s = server_factory("k3")
    _flush(s)
    rng = random.Random(13)
    a = random_tokens(rng, 1000)
    s.generate(a, 3)
    st = k3_state(s)
    row = st["checkpoint_slot_bytes"]
    assert st["export_stash_last_bytes"] == row  # the last grid point before the prompt end only
    assert st["export_stash_bytes"] == 0  # dropped once the request checkpointed, not held idle
    # What keeping the forward's full tensors would hold: h at all 15 boundaries plus the whole
    # pre-conv stream of each layer.
    assert st["export_full_peak_bytes"] > 15 * row
    # A request sharing 300 tokens with `a`: its extend keeps the prompt-end row and the row at
    # the branch point (256): two rows, and they are what a third sibling restores from.
    b = a[:300] + random_tokens(rng, 700)
    s.generate(b, 3)
    st = k3_state(s)
    assert st["export_stash_last_bytes"] == 2 * row and st["export_stash_bytes"] == 0
    assert st["export_stash_peak_bytes"] >= 2 * row  # a lifetime peak (the server is shared)
    c = s.generate(a[:300] + random_tokens(rng, 100), 3)
    assert c["meta_info"]["cached_tokens"] == 256
    # c's extend runs from 256 to 400 (grid points 320 and 384): only the prompt-end one is kept.
    assert k3_state(s)["export_stash_last_bytes"] == row


def test_quantized_hits_of_a_forward_are_restored_together(server_factory):
    """Eight requests that hit the same int8 checkpoint, sent as one batch: each is restored at its
    forward (8 restores), several hits per restore launch (fewer flushes than restores), and every
    restored request gets the same greedy tokens as the request that made the checkpoint."""
    s = server_factory("k3_int8")
    _flush(s)
    ids = random_tokens(random.Random(13), 150)
    first = s.generate(ids, 5)
    before = k3_state(s)
    outs = s.generate([ids] * 8, 5)
    after = k3_state(s)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [128] * 8
    assert all(o["output_ids"] == first["output_ids"] for o in outs)
    restores = after["deferred_restores"] - before["deferred_restores"]
    flushes = after["deferred_restore_flushes"] - before["deferred_restore_flushes"]
    print(f"\n8 hits restored in {flushes} launch(es)")
    assert restores == 8
    assert 1 <= flushes < 8


def test_aborted_requests_leave_nothing_behind(server_factory):
    """Twelve concurrent requests sharing a cached prefix (more than the server runs at once, so
    some wait), all aborted mid-flight: the cache then tracks no request, a restore launch was not
    left pending, and the server still serves the prefix from its checkpoint."""

    s = server_factory("k3_int8")
    _flush(s)
    rng = random.Random(14)
    shared = random_tokens(rng, 200)
    s.generate(shared, 2)  # the prefix's checkpoints (exported at 192, prompt end at 200)
    prompts = [shared + random_tokens(rng, 40) for _ in range(12)]
    results = abort_all_mid_flight(s, prompts, 400, after_s=3.0)
    finished = [r for r in results if isinstance(r, dict)]
    aborted = [r for r in finished if r["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted, [r["meta_info"]["finish_reason"] for r in finished]
    state = k3_state(s)
    assert state["tracked_requests"] == 0
    again = s.generate(prompts[0], 3)
    # the prompt-end checkpoint, or the exported one below it if the aborted requests' own
    # checkpoints pushed it out
    assert again["meta_info"]["cached_tokens"] in (192, 200)
    assert k3_state(s)["tracked_requests"] == 0


def test_quantized_stores_of_a_step_run_together(server_factory):
    """Four new prompts in one batch: their generation-end checkpoints are stored per scheduler
    step, several in one launch, and the states their prefill exported (the 64-token boundary
    below each prompt end) all in one launch too. (Under the overlap scheduler the live slots are
    a decode token past the prompt ends when those are checkpointed, so no live copy is made
    there: ``stale_state_skips``.) When a generation-end state lands, the prompt-end
    state at 150 it supersedes leaves the tree (one state per turn, unless the reuse learner keeps
    it) and the exported one at 128 stays (marked superseded: priced at 0 under pressure) for a
    repeat of the prompt, so a request that continues the prompt differently restores at 128 or
    150."""
    s = server_factory("k3_int8")
    _flush(s)
    rng = random.Random(15)
    prompts = [random_tokens(rng, 150) for _ in range(4)]
    before = k3_state(s)
    s.generate(prompts, 4)
    after = k3_state(s)
    stored = after["stores_flushed"] - before["stores_flushed"]
    flushes = after["store_flushes"] - before["store_flushes"]
    ahead = after["export_ahead_stored"] - before["export_ahead_stored"]
    print(f"\n{stored} checkpoints stored in {flushes} launch(es), {ahead} exported states stored ahead")
    assert stored >= 4 and flushes < stored
    assert ahead >= 4
    for p in prompts:
        out = s.generate(p + random_tokens(rng, 20), 2)
        # 150 where the reuse learner kept the prompt-end state (its class has been reused on this
        # shared server: sglang_k3/cache/ghosts.py), else 128
        assert out["meta_info"]["cached_tokens"] in (128, 150)
