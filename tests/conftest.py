"""Shared fixtures: one real server per configuration, started once per test session.

A CPU server start costs 20-60 s, so servers are session-scoped and started lazily: a test run
that selects only unit tests starts none.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: benchmarks.*

from server_schedule import evict, factory_names, order_modules, predicted_servers, server_starts  # noqa: E402
from server_utils import Server  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_seeded_per_test(request):
    """Each test starts torch's global generator from a seed of its own id, so a test that draws
    without a generator of its own draws the same numbers whatever ran before it (CI once failed
    on a draw that only that order of tests produced)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# Flags per configuration, on top of launch_server's defaults (embedded model, CPU defaults).
SERVER_CONFIGS: dict[str, list[str]] = {
    "nocache": ["--disable-radix-cache"],
    # SGLang's own cache with no_buffer (states copied at request ends), overlap off (SGLang
    # asserts it there): the baseline the earlier tests were written against. launch_server's
    # default for SGLang's own cache is extra_buffer (upstream_extra_buffer below).
    "upstream": ["--radix-cache-backend", "upstream", "--mamba-radix-cache-strategy", "no_buffer"],
    # Upstream at its real GPU default for Kimi Linear: extra_buffer (states tracked into spare
    # slots) with the overlap scheduler on (launch_server leaves it on for extra_buffer), on CPU
    # through patches/mamba_track_states.py and patches/schedule_batch_decode_pin.py.
    "upstream_extra_buffer": ["--radix-cache-backend", "upstream", "--mamba-radix-cache-strategy", "extra_buffer"],
    # launch_server's default backend is k3, with the overlap scheduler on; fp32 checkpoints are
    # the bit-exact differential oracle.
    "k3": ["--k3-checkpoint-dtype", "fp32"],
    # The same with NGRAM speculative decoding (four drafts a verify; on CPU launch_server makes
    # them one chain, and SGLang turns the overlap scheduler off for it).
    "k3_spec": [
        "--k3-checkpoint-dtype",
        "fp32",
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "4",
    ],
    # The same with the overlap scheduler off (checkpoints copied from the live state at once).
    "k3_no_overlap": ["--k3-checkpoint-dtype", "fp32", "--disable-overlap-schedule"],
    # Small prefill chunks, small pools, a decode checkpoint every 8 tokens: chunk and decode
    # checkpoints, recycling and eviction all happen.
    "k3_small": [
        "--k3-checkpoint-dtype",
        "fp32",
        "--chunked-prefill-size",
        "96",
        "--max-total-tokens",
        "1536",
        "--max-mamba-cache-size",
        "12",
        "--k3-decode-checkpoint-interval",
        "8",
    ],
    # The user-facing default: int8 checkpoints in their own pool (small, so it evicts).
    "k3_int8": ["--k3-checkpoint-slots", "16"],
    # Unified memory under pressure: a budget of about 15 blocks (3,072 KV tokens and 6 state slots
    # as SGLang sizes them), 4 running requests; fp32 checkpoints so greedy tokens are exact.
    "k3_pressure": [
        "--k3-checkpoint-dtype",
        "fp32",
        "--max-total-tokens",
        "3072",
        "--max-mamba-cache-size",
        "6",
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        "256",
    ],
    # The live A/B's --pressure budget (benchmarks/live_ab.py: 1,536 KV tokens and 12 state slots
    # as SGLang sizes them, 4 running requests) with fp32 checkpoints, for workloads that cycle
    # through it (tests/test_waiting_queue_server.py).
    "k3_cycling": [
        "--max-total-tokens",
        "1536",
        "--max-mamba-cache-size",
        "12",
        "--max-running-requests",
        "4",
    ],
    # A host tier under a device budget far too small for the workload (1,024 KV tokens, 6 state
    # slots): most hits come back from host memory; prompts also park a state below the device every
    # 128 tokens; fp32 checkpoints so greedy tokens are exact.
    "k3_host_tier": [
        "--k3-checkpoint-dtype",
        "fp32",
        "--max-total-tokens",
        "1024",
        "--max-mamba-cache-size",
        "6",
        "--max-running-requests",
        "2",
        "--k3-host-tier-gib",
        "1",
        "--k3-tier-park-interval",
        "128",
    ],
    # KV pages of 64 tokens (FlashMLA's size on a GPU), overlap on and off, fp32 and int8: a turn
    # that ends inside a page keeps its partial page, and the next turn restores inside it.
    "k3_page64": ["--k3-checkpoint-dtype", "fp32", "--page-size", "64"],
    "k3_page64_no_overlap": ["--k3-checkpoint-dtype", "fp32", "--page-size", "64", "--disable-overlap-schedule"],
    "k3_page64_int8": ["--page-size", "64", "--k3-checkpoint-slots", "16"],
    # Pages larger than the 64-token state grid: every other (every fourth) grid state lies inside
    # a page, and restores there copy the page's prefix out.
    "k3_page128": ["--k3-checkpoint-dtype", "fp32", "--page-size", "128"],
    "k3_page256": ["--k3-checkpoint-dtype", "fp32", "--page-size", "256"],
    # k3 defaults with Prometheus on (tests/test_k3_observability.py; /server_info needs no flag).
    "k3_metrics": ["--enable-metrics"],
}

# The host tier under the same small device budget with KV pages of 64 tokens.
SERVER_CONFIGS["k3_host_tier_page64"] = [*SERVER_CONFIGS["k3_host_tier"], "--page-size", "64"]
# Pages of 16 with k3_small's chunks and pools: chunk ends, evictions and restores inside pages all
# happen; its 96-token chunks end on page boundaries but off the 64-token grid.
SERVER_CONFIGS["k3_page16_small"] = [*SERVER_CONFIGS["k3_small"], "--page-size", "16"]
# NGRAM with SGLang's own retraction test hook: every third forward retracts running decodes (the
# scheduler's path for a full KV pool, with its log line "Testing retraction"), so retraction
# mid-speculation happens on CPU, where admission stops at the state slots before KV runs out.
SERVER_CONFIGS["k3_spec_retract"] = SERVER_CONFIGS["k3_spec"]
SERVER_ENVS: dict[str, dict[str, str]] = {
    "k3_spec_retract": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"},
}

# The full tier: end-to-end runs that start fleets or several servers of their own, each worth
# minutes of a 2-core machine. ``python -m pytest tests -q`` (the README's command, what CI runs)
# skips them, saying so; ``--full`` runs them too. On the 2-core CI machine the whole suite took
# about two hours (a server start is ~60 s there, ~40 of it importing SGLang in the launcher and
# again in the scheduler), past CI's limit; what each entry costs and what the default tier keeps
# in its place: docs/testing.md. A node id listed here matches itself and everything under it.
FULL_TIER: dict[str, str] = {
    "tests/test_fleet.py": "a fleet of three instances behind sglang-router, and a master",
    "tests/test_fleet_benchmarks.py::test_fleet_ab_small": "benchmarks.fleet_ab end to end: four servers, two fleets",
    "tests/test_fleet_benchmarks.py::test_fleet_burst_small": "benchmarks.fleet_burst end to end: two fleets",
    "tests/test_pd_fleet.py": "a prefill/decode fleet behind sglang-router",
    "tests/test_start_fleet.py": "scripts/start_fleet.py end to end, one fleet per shape",
    "tests/test_mooncake_servers.py": "two servers sharing a Mooncake L3, and its master",
    "tests/test_live_ab.py::test_live_ab_end_to_end": "benchmarks.live_ab end to end: three servers",
    "tests/test_live_ab.py::test_pressure_end_to_end": "benchmarks.live_ab --pressure end to end: three servers",
    "tests/test_tier_ab.py::test_tier_ab_end_to_end": "benchmarks.tier_ab end to end: its servers and a master",
    "tests/test_overlap_ab.py::test_overlap_ab_end_to_end": "benchmarks.overlap_ab end to end: two servers",
    "tests/test_checkpoint_flips_cli.py::test_small_run_against_session_servers": (
        "benchmarks.checkpoint_flips end to end"
    ),
    "tests/test_noise_differential.py::test_a_corrupted_restore_is_flagged_and_exact_ones_are_not": (
        "benchmarks.noise_differential end to end: its servers"
    ),
    "tests/test_server_port_clash.py::test_a_taken_port_at_start_is_retried_on_a_fresh_one": "two server starts",
    "tests/test_differential_upstream.py": "SGLang's own cache against cache off (the baseline's correctness)",
    "tests/test_speculative_eagle_server.py::test_conversations_and_branches_hit_as_without_speculation[k3_eagle3]": (
        "a third speculative server (EAGLE3; the EAGLE one runs in the default tier)"
    ),
}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the full tier too (tests/conftest.py FULL_TIER)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: an end-to-end run of the full tier (tests/conftest.py FULL_TIER)")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: order what will run
def pytest_collection_modifyitems(config, items):
    run_full = config.getoption("--full")
    for item in items:
        name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
        node = f"tests/{os.path.relpath(item.path, os.path.dirname(__file__))}::{name}".rstrip(":")
        why = next((w for prefix, w in FULL_TIER.items() if node == prefix or node.startswith(prefix + "::")), None)
        if why is None:
            continue
        item.add_marker(pytest.mark.full)
        if not run_full:
            item.add_marker(pytest.mark.skip(reason=f"full tier ({why}): run with --full"))
    _schedule_servers(items)


# Per test about to run (in run order), the server configurations it is predicted to ask for; and
# the position of the test now running. get_server's eviction reads both (tests/server_schedule.py).
_schedule: list[tuple[str, ...]] = []
_positions: dict[str, int] = {}
_position = 0


def _schedule_servers(items) -> None:
    """Reorders ``items`` module by module to start the fewest servers, and records what each test
    will ask for (tests/server_schedule.py)."""
    known = frozenset(SERVER_CONFIGS) | frozenset(factory_names({str(item.path) for item in items}))
    modules: dict[str, list] = {}
    for item in items:
        skipped = item.get_closest_marker("skip") is not None
        params = item.callspec.params if hasattr(item, "callspec") else {}
        fixtures = item.fixturenames
        names = () if skipped else predicted_servers(str(item.path), item.originalname, params, fixtures, known)
        modules.setdefault(str(item.path), []).append((item, names))
    order = order_modules({m: [n for _, n in tests] for m, tests in modules.items()}, MAX_LIVE_SERVERS)
    items[:] = [item for m in order for item, _ in modules[m]]
    _schedule[:] = [names for m in order for _, names in modules[m]]
    _positions.clear()
    _positions.update((item.nodeid, i) for i, item in enumerate(items))


def pytest_report_collectionfinish(config, start_path, items):
    if any(_schedule):
        starts = server_starts(_schedule, MAX_LIVE_SERVERS)
        configs = len({n for names in _schedule for n in names})
        return f"session servers: {starts} starts predicted for {configs} configurations"
    return None


def pytest_terminal_summary(terminalreporter):
    if _started:
        terminalreporter.write_line(f"session servers: {len(_started)} started ({len(set(_started))} configurations)")


def pytest_runtest_logstart(nodeid, location):
    global _position
    _position = _positions.get(nodeid, _position)


_servers: dict[str, Server] = {}  # least recently used first
_started: list[str] = []  # every start this session, in order
# Servers kept alive at once. Each takes 1-3 GB in three processes; with every configuration alive
# to the end, a 24 GiB CI machine ran short of page cache for the 11 GB environment and a late
# server took minutes to start. Tests use one or two configurations at a time (most with
# ``nocache``); the one the remaining tests need farthest ahead is stopped first and restarted if
# asked for again, and test modules run in the order that needs the fewest starts
# (tests/server_schedule.py).
MAX_LIVE_SERVERS = 4


def get_server(name: str) -> Server:
    srv = _servers.pop(name, None)
    if srv is None or not srv.alive():
        while len(_servers) >= MAX_LIVE_SERVERS:
            old_name = evict(list(_servers), _schedule[_position:])
            _servers.pop(old_name).stop()
            print(f"\n[server {old_name}] stopped (next needed farthest ahead)", file=sys.stderr)
        srv = Server(name, SERVER_CONFIGS[name], env=SERVER_ENVS.get(name)).start()
        _started.append(name)
        print(f"\n[server {name}] healthy after {srv.start_seconds:.1f}s at {srv.url}", file=sys.stderr)
    _servers[name] = srv  # most recently used last
    return srv


def stop_servers_except(*keep: str) -> None:
    """Stop every session server but ``keep``: a test module about to start several servers of
    its own (a fleet) makes room first."""
    for name in [n for n in _servers if n not in keep]:
        _servers.pop(name).stop()
        print(f"\n[server {name}] stopped to make room", file=sys.stderr)


@pytest.fixture(scope="session")
def server_factory():
    yield get_server
    for srv in _servers.values():
        srv.stop()
    _servers.clear()


_references: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def nocache_reference(server_factory):
    """``reference(key, run)``: the cache-off server's answers to a seeded workload, ``run(server)``,
    computed once per ``key`` (name the workload and its seed) and shared by every configuration a
    differential compares against it. The reference is greedy decoding on fp32 CPU with no cache,
    the same for every comparison (each differential asserts exactly that determinism); running it
    again per configuration only cost CI time (16 runs of two scripts in test_differential_k3)."""

    def reference(key: tuple, run):
        if key not in _references:
            _references[key] = run(server_factory("nocache"))
        return _references[key]

    return reference


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    from sglang_k3.model.tiny_build import default_model_path

    return default_model_path()
