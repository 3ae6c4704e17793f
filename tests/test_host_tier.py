"""The host tier through a real server: a device budget far too small for the workload
(``k3_host_tier``: 1,024 KV tokens, 6 state slots) and a 1 GiB host tier, at KV pages of 1 and
of 64 tokens.

Eight conversations over one system prompt take turns round-robin, so by the time a conversation
comes back, the device has evicted its state and KV. The cases are named after upstream's open
bugs in its hybrid host tier, whose shapes they exercise:

* sglang#33713 (states pruned on device eviction are never loaded back): the evicted turn ends
  come back from the host (``tier_host_hits``) and later turns report cached tokens;
* sglang#39830 (a host-tier hit gives wrong output): greedy tokens equal the cache-off server's;
* sglang#39147 (unrestorable prefixes reported as hits): every reported hit is a boundary that
  loaded, state and KV (``tier_loads`` counts only complete, validated boundaries; the tier unit
  tests cover the half-present boundary), and the server's restore records agree with what each
  request reports.
"""

from __future__ import annotations

import random

import pytest
from server_utils import k3_state
from workloads import random_tokens, run_conversations

SEED = 4242
KW = dict(n_conv=8, n_turns=3, system_len=120, user_len=(200, 260), reply_len=6)


@pytest.fixture(scope="module", params=["k3_host_tier", "k3_host_tier_page64"])
def runs(server_factory, nocache_reference, request):
    """Pages of 1 and of 64 tokens: the host tier moves KV whole pages at a time at 64, and a turn
    end inside a page comes back as a partial page."""
    tier = server_factory(request.param)
    before = k3_state(tier)
    cached = run_conversations(tier, SEED, **KW)
    after = k3_state(tier)
    plain = nocache_reference(("host_tier", SEED), lambda s: run_conversations(s, SEED, **KW))
    return cached, plain, before, after


def test_evicted_states_come_back_from_host_sglang_33713(runs):
    cached, _, before, after = runs
    assert after["evicted_checkpoints"] > before["evicted_checkpoints"]  # the device did evict
    loads = after["tier_host_hits"] - before["tier_host_hits"]
    assert loads >= 8, after
    later = [r for r in cached if r["turn"] > 0]
    hit = sum(r["cached_tokens"] for r in later) / sum(r["prompt_len"] for r in later)
    print(f"host tier: later-turn hit rate {hit:.3f}, {loads} boundaries loaded from host")
    assert hit > 0.5
    assert after["tier_invalid_objects"] == 0 and after["tier_errors"] == 0


def test_host_hits_give_the_cache_off_greedy_tokens_sglang_39830(runs):
    cached, plain, _, _ = runs
    assert [r["output_ids"] for r in cached] == [r["output_ids"] for r in plain]
    assert all(r["cached_tokens"] == 0 for r in plain)


def test_reported_hits_are_restorable_boundaries_sglang_39147(runs):
    cached, _, before, after = runs
    # Every cached token a request reports is a restore boundary the tree matched with a state
    # (its hit_tokens), and what came from the host arrived as complete boundaries.
    reported = sum(r["cached_tokens"] for r in cached)
    restored = after["hit_tokens"] - before["hit_tokens"]
    assert reported == restored
    assert after["tier_incomplete"] == before["tier_incomplete"]
    assert after["tier_loads"] - before["tier_loads"] == after["tier_host_hits"] - before["tier_host_hits"]


def test_a_first_time_fork_inside_an_earlier_prompt_restores_near_the_fork(server_factory):
    """Dense states below the device (``--k3-tier-park-interval 128``): a request that forks inside
    an earlier prompt, where the device never kept a state, restores from the parked state at the
    last multiple of 128 before the fork (upstream and a device-only k3 recompute from the last
    state they kept, here none). Parking passes each state through a checkpoint slot of the device
    budget for a moment; in this tiny budget, full from the tests before, it would have to evict
    for one, so the device is flushed first (the host tier survives a flush)."""
    tier, plain = server_factory("k3_host_tier"), server_factory("nocache")
    tier.flush_cache()
    rng = random.Random(SEED + 1)
    first = random_tokens(rng, 700)
    parked = k3_state(tier)["tier_parked"]
    tier.generate(first, 4)
    before = k3_state(tier)
    assert before["tier_parked"] - parked == 4  # 128, 256, 384, 512 (640 is the prompt end's, kept on the device)
    fork = first[:450] + random_tokens(rng, 60)
    out = tier.generate(fork, 6)
    after = k3_state(tier)
    assert out["meta_info"]["cached_tokens"] == 384, out["meta_info"]
    assert after["tier_loads"] == before["tier_loads"] + 1
    assert out["output_ids"] == plain.generate(fork, 6)["output_ids"]
