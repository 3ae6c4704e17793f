"""The session servers' schedule (tests/server_schedule.py): eviction by farthest next use, the
start count it implies, the module order search, and the prediction read from test sources."""

from __future__ import annotations

import ast
import os
import random

from conftest import SERVER_CONFIGS
from server_schedule import evict, factory_names, order_modules, predicted_servers, server_starts

HERE = os.path.dirname(os.path.abspath(__file__))


def _lru_starts(schedule, slots):
    live, starts = [], 0
    for names in schedule:
        for name in names:
            if name in live:
                live.remove(name)
            else:
                starts += 1
                if len(live) >= slots:
                    live.pop(0)
            live.append(name)
    return starts


def test_evict_prefers_never_needed_then_farthest_then_least_recent():
    future = [("a",), ("b",), ("c",)]
    assert evict(["a", "b", "c", "d"], future) == "d"  # d is never asked for again
    assert evict(["a", "b", "c"], future) == "c"  # c is needed last
    assert evict(["x", "y"], future) == "x"  # neither needed: the least recently used


def test_starts_count_the_farthest_rule_and_never_exceed_lru():
    # a b c a b c with two slots: LRU misses every time (6); keeping a and evicting by next use, 4.
    cyclic = [("a",), ("b",), ("c",), ("a",), ("b",), ("c",)]
    assert _lru_starts(cyclic, 2) == 6
    assert server_starts(cyclic, 2) == 4
    rng = random.Random(5)
    for _ in range(200):
        sched = [tuple(rng.sample("abcdefg", rng.randint(0, 2))) for _ in range(rng.randint(1, 30))]
        slots = rng.randint(1, 4)
        distinct = len({n for names in sched for n in names})
        got = server_starts(sched, slots)
        assert distinct <= got <= _lru_starts(sched, slots), (sched, slots)


def test_module_order_keeps_every_module_puts_serverless_first_and_never_costs_more():
    rng = random.Random(11)
    for _ in range(20):
        modules = {}
        for m in range(rng.randint(2, 12)):
            modules[f"m{m}"] = [tuple(sorted(set(rng.sample("abcdef", rng.randint(0, 2))))) for _ in range(3)]
        order = order_modules(modules, slots=2, rounds=300)
        assert sorted(order) == sorted(modules)
        quiet = [m for m in modules if not any(modules[m])]
        assert order[: len(quiet)] == quiet
        cost = server_starts([t for m in order for t in modules[m]], 2)
        assert cost <= server_starts([t for m in modules for t in modules[m]], 2)
        assert order == order_modules(modules, slots=2, rounds=300)  # seeded: the same every run


def test_prediction_reads_parameters_factory_literals_fixtures_and_the_reference():
    known = frozenset(SERVER_CONFIGS)
    diff = os.path.join(HERE, "test_differential_k3.py")
    got = predicted_servers(
        diff,
        "test_k3_greedy_equals_no_cache",
        {"config": "k3_small", "seed": 1},
        ["server_factory", "nocache_reference", "config", "seed"],
        known,
    )
    assert got == ("k3_small", "nocache")
    # literals in the test body: both servers of a two-server test
    live = os.path.join(HERE, "test_overlap_k3.py")
    with open(live) as f:
        names = [
            n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        ]
    found = {predicted_servers(live, n, {}, ["server_factory"], known) for n in names}
    assert ("k3", "nocache") in found
    # a module fixture with parameters: the parameter names the server
    tier = os.path.join(HERE, "test_host_tier.py")
    got = predicted_servers(
        tier,
        "test_host_hits_give_the_cache_off_greedy_tokens_sglang_39830",
        {"runs": "k3_host_tier_page64"},
        ["runs", "server_factory", "nocache_reference", "request"],
        known,
    )
    assert got == ("k3_host_tier_page64", "nocache")
    # an f-string over the test's parameters
    pages = os.path.join(HERE, "test_page_sizes.py")
    got = predicted_servers(
        pages, "test_paged_servers_run_on_the_unified_budget", {"page": 128}, ["server_factory", "page"], known
    )
    assert got == ("k3_page128",)
    # a configuration a module registers while it runs is known by the name passed to the factory
    eagle = os.path.join(HERE, "test_speculative_eagle_server.py")
    assert {"k3_eagle", "k3_fixed_sync"} <= factory_names([eagle])
    # a unit test asks for nothing
    assert predicted_servers(os.path.join(HERE, "test_tree_match.py"), "nothing_here", {}, [], known) == ()
