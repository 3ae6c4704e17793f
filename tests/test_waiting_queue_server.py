"""Eviction that reads the waiting queue, through a real server (``k3_pressure``: a unified budget
of about 3,072 KV tokens, 4 running requests). Sixteen conversations over one system prompt send
their turns at once, each the moment its last one returns, so twelve wait at any time and a turn
comes back only after the other fifteen ran: their histories (about 4,900 tokens) cycle through a
budget that holds a fraction of them. Plain LRU keeps the turn that just finished, whose next turn is the
last in the queue, and loses every queued one before it is admitted. The k3 tree evicts what no
queued request wants first, then the queue from its tail (``patches/schedule_policy_waiting_refresh.py``
refreshes the queue's prefixes while the cache evicts), so the conversations near the head keep
their last turn. Checkpoints are int8 here (the default: fp32 states are four times larger and this
budget then keeps almost nothing), so greedy tokens are compared with a cache-off server's as
agreement, as ``test_int8_agreement.py`` does. The workload is the live A/B's ``multiturn``
(``benchmarks/live/workloads.py``); the seed is in the test id."""

from __future__ import annotations

import pytest
from server_utils import k3_state

from benchmarks.live import workloads as wl

SYSTEM, FIRST, USER, REPLY, CONVERSATIONS, TURNS = 128, 128, 48, 8, 16, 4


def _agreeing(a: list, b: list) -> int:
    """Output tokens of ``b`` that ``a`` matches before they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _run(s, vocab, seed):
    return wl.run_multiturn(
        s.url,
        s.name,
        vocab,
        conversations=CONVERSATIONS,
        turns=TURNS,
        system_len=SYSTEM,
        first_len=FIRST,
        user_len=USER,
        reply_len=REPLY,
        seed=seed,
        verbose=False,
    )


@pytest.mark.parametrize("seed", [7])
def test_queued_conversations_keep_their_turns_under_a_cycling_budget(server_factory, embedded_model_dir, seed):
    vocab = wl.vocabulary(embedded_model_dir)
    k3 = server_factory("k3_cycling")
    before = k3_state(k3)
    summary, outputs = _run(k3, vocab, seed)
    after = k3_state(k3)
    plain_summary, plain = _run(server_factory("nocache"), vocab, seed)
    assert summary["errors"] == 0 and plain_summary["errors"] == 0
    assert outputs.keys() == plain.keys()
    agree = sum(_agreeing(outputs[k], plain[k]) for k in plain)
    assert agree / sum(len(v) for v in plain.values()) > 0.9
    assert after["evicted_checkpoints"] > before["evicted_checkpoints"]  # the budget did cycle
    assert after["waiting_refreshes"] > before["waiting_refreshes"]
    # The shared system prompt alone gives less than 64 x 128 (the first turns arrive before it is
    # cached); more is later turns restoring their own conversation's history, kept through a
    # cycle of the other fifteen. Measured: 9,086 cached tokens; before this eviction order the
    # live A/B's same workload hit 60 x 128 = 7,680, every turn's own state evicted before it came.
    assert summary["cached_tokens"] > CONVERSATIONS * TURNS * SYSTEM, summary
