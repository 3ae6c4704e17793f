"""The main oracle: greedy tokens with the ``k3`` cache equal greedy tokens with no cache.

Seeded random scripts (multi-turn conversations over a shared system prompt, fork branches sent
concurrently, repeated prompts, prompts ending mid-chunk) run against ``k3`` servers and a
``--disable-radix-cache`` server. ``k3`` runs with the overlap scheduler on (launch_server's
default), ``k3_no_overlap`` with it off. ``k3_small`` (overlap on) uses 96-token prefill chunks and
small KV and state pools, so chunk checkpoints, recycling and eviction all happen. The
``k3_page*`` servers run with KV pages of 64 and 16 tokens (overlap on and off), where a turn end
inside a page is restored through a copy of that page (pages of 128 and 256: test_page_sizes.py);
``k3_host_tier_page64`` brings evicted boundaries back from host memory at pages of 64. Seeds are
recorded in the test ids.
"""

from __future__ import annotations

import pytest
from scripted_workload import compare, make_script, run_script

SEEDS = [101, 202]


CONFIGS = [
    "k3",
    "k3_no_overlap",
    "k3_small",
    "k3_host_tier",
    "k3_host_tier_page64",
    "k3_page64",
    "k3_page64_no_overlap",
    "k3_page16_small",
]


# The seed varies fastest (the top decorator's parameter does): a configuration's server serves
# both seeds in a row. With the configuration fastest, the session's four live servers cycled and
# every configuration's server started twice (conftest.MAX_LIVE_SERVERS).
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_k3_greedy_equals_no_cache(server_factory, nocache_reference, config, seed):
    script = make_script(seed)
    cached = run_script(server_factory(config), script)
    plain = nocache_reference(("scripted_workload", seed), lambda s: run_script(s, script))
    assert compare(cached, plain) == []
    assert all(r["cached_tokens"] == 0 for r in plain)
    later_turns = [r for r in cached if r["kind"] == "turn" and r["round"] > 0]
    assert sum(r["cached_tokens"] for r in later_turns) > 0
