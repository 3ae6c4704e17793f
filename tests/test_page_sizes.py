"""k3 with KV pages over one token: a turn that ends inside a page is restored exactly there.

The finished turn keeps its last, partial page in the tree (a ragged leaf, with the state at its
exact end); the next turn restores inside that page and continues in a copy of it, never in the
tree's page. Hits must land where they land with one-token pages, and greedy tokens must equal a
cache-off server's (fp32 checkpoints). At every page size the KV pages, the running states and
the checkpoints share the unified budget (SGLang's paged allocator over the ledger's blocks).
"""

from __future__ import annotations

import random

import pytest
from server_utils import k3_state


def _conversation(server, seed: int) -> list[dict]:
    """Three turns; every turn's end (prompt + reply) falls inside a 64-token page."""
    rng = random.Random(seed)
    history = [rng.randint(32, 126) for _ in range(rng.randint(130, 180))]
    out = []
    for _ in range(3):
        prompt = history + [rng.randint(32, 126) for _ in range(rng.randint(20, 50))]
        reply = 9 if (len(prompt) + 8) % 64 else 10  # the state ends on no page boundary
        o = server.generate(prompt, reply)
        out.append({"prompt_len": len(prompt), "cached": o["meta_info"]["cached_tokens"], "ids": o["output_ids"]})
        history = prompt + o["output_ids"]
    return out


@pytest.mark.parametrize("page, seed", [(64, 11), (64, 12), (128, 13), (256, 14)])
def test_a_turn_end_inside_a_page_is_restored_exactly_there(server_factory, page, seed):
    paged, plain = server_factory(f"k3_page{page}"), server_factory("nocache")
    copies_before = k3_state(paged)["kv_page_copies"]
    got, want = _conversation(paged, seed), _conversation(plain, seed)
    assert [t["ids"] for t in got] == [t["ids"] for t in want]
    for prev, turn in zip(got, got[1:]):
        # the previous turn's state: its prompt and every reply token but the last (never fed in)
        end = prev["prompt_len"] + len(prev["ids"]) - 1
        assert end % 64 and turn["cached"] == end, (prev, turn)
    assert k3_state(paged)["kv_page_copies"] >= copies_before + 2


def test_pages_of_64_hit_where_pages_of_1_hit(server_factory):
    """The same conversations on a one-token-page k3 server: the same cached tokens, turn by turn."""
    paged, flat = server_factory("k3_page64"), server_factory("k3")
    for seed in (21, 22):
        got, ref = _conversation(paged, seed), _conversation(flat, seed)
        assert [t["cached"] for t in got] == [t["cached"] for t in ref]
        assert [t["ids"] for t in got] == [t["ids"] for t in ref]


@pytest.mark.parametrize("page", [64, 128, 256])
def test_paged_servers_run_on_the_unified_budget(server_factory, page):
    """No fallback to SGLang's fixed pools: the budget is reported, KV blocks hold whole pages,
    and after the conversations above the KV in them is live and checkpoints were stored there."""
    paged = server_factory(f"k3_page{page}")
    _conversation(paged, 30 + page)
    st = k3_state(paged)
    assert st["memory_budget_bytes"] > 0, st
    assert 0 < st["memory_kv_used_bytes"] <= st["memory_kv_bytes"], st
    assert st["memory_peak_checkpoint_bytes"] > 0, st
    split = ("memory_kv_bytes", "memory_active_bytes", "memory_checkpoint_bytes", "memory_free_bytes")
    assert sum(st[k] for k in split) + st["memory_reserved_bytes"] == st["memory_budget_bytes"], st
