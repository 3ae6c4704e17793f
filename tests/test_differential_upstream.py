"""Differential baseline: upstream's hybrid radix cache vs. no cache on multi-turn conversations.

The same interleaved conversations (shared system prompt, 4 turns, prompts longer than one KDA
chunk) must give identical greedy tokens with SGLang's default hybrid cache and with
``--disable-radix-cache``; later turns must report cached tokens. Both of upstream's strategies:
``no_buffer`` (the CPU default) and ``extra_buffer`` (its GPU default for Kimi Linear, run on CPU
through sglang-k3's patches of its state-tracking copy).
"""

from __future__ import annotations

import pytest
from workloads import run_conversations

SEEDS = [7, 8]


@pytest.mark.parametrize("config", ["upstream", "upstream_extra_buffer"])
@pytest.mark.parametrize("seed", SEEDS)
def test_upstream_cache_matches_no_cache(server_factory, nocache_reference, seed, config):
    cached = run_conversations(server_factory(config), seed)
    plain = nocache_reference(("run_conversations", seed), lambda s: run_conversations(s, seed))
    for a, b in zip(cached, plain):
        assert a["output_ids"] == b["output_ids"], (a, b)
        assert b["cached_tokens"] == 0
    later = [r for r in cached if r["turn"] >= 1]
    assert all(r["cached_tokens"] > 0 for r in later), [(r["conv"], r["turn"], r["cached_tokens"]) for r in later]
