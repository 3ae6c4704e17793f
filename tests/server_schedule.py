"""Which session servers each test will ask for, and the module order that starts the fewest.

A CPU server start costs about a minute on the 2-core CI machine, and the session keeps at most
``conftest.MAX_LIVE_SERVERS`` alive. In file order with least-recently-used eviction, the default
tier started 36 servers for 21 configurations (1,652 s of its 3,002 s were starts). Two changes,
both decided here:

* **Prediction.** ``predicted_servers`` reads a test's server configurations from its source: the
  configuration names among its parameters, the names passed to ``server_factory`` in the test
  function and in the module's fixtures it uses (literals, or f-strings over the test's
  parameters), and ``nocache`` for ``nocache_reference``. It can miss a name computed otherwise
  or count one a cached reference never asks for; either only costs speed, never correctness.
* **Order and eviction.** ``order_modules`` orders test modules (each stays whole, its tests in
  file order) to need the fewest starts, and ``evict`` stops the live server whose next predicted
  use is farthest away (Belady's rule), unknown or unused ones first. ``server_starts`` simulates
  both; ``order_modules`` searches module orders with it, seeded, so every run gets the same order.

Tests must not depend on the order they run in; this makes that a requirement the suite
exercises. Nothing here imports pytest or starts anything.
"""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Iterable, Sequence
from typing import Optional

NEVER = 1 << 30


@functools.lru_cache(maxsize=None)
def _module_defs(path: str) -> dict[str, ast.FunctionDef]:
    with open(path) as f:
        tree = ast.parse(f.read())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _name(arg: ast.expr, params: dict[str, object]) -> Optional[str]:
    """A ``server_factory`` argument's value where the source gives it: a string literal, or an
    f-string over the test's parameters (``f"k3_page{page}"``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):
        parts = []
        for v in arg.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in params:
                parts.append(str(params[v.value.id]))
            else:
                return None
        return "".join(parts)
    return None


def _literals(node: ast.AST, known: Optional[frozenset[str]] = None, params: Optional[dict] = None) -> set[str]:
    """Configuration names passed to ``server_factory(...)`` inside ``node`` as literals or
    f-strings over ``params`` (those in ``known``, if given)."""
    found = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "server_factory":
            found |= {n for a in call.args if (n := _name(a, params or {})) is not None}
    return found if known is None else found & known


def factory_names(paths: Iterable[str]) -> set[str]:
    """Every name the modules at ``paths`` pass as a literal to ``server_factory``: configurations a
    module registers while it runs (the EAGLE servers, whose draft is built then) included."""
    names: set[str] = set()
    for path in paths:
        for fn in _module_defs(path).values():
            names |= _literals(fn)
    return names


def predicted_servers(
    path: str, function: str, params: dict[str, object], fixtures: Iterable[str], known: frozenset[str]
) -> tuple[str, ...]:
    """The server configurations one test is expected to ask for, sorted.

    ``path``/``function``: the test's module file and function name; ``params``: its parameter
    values (pytest's ``callspec.params``, fixture parameters included); ``fixtures``: the fixture
    names it uses; ``known``: the configuration names."""
    found = {v for v in params.values() if isinstance(v, str) and v in known}
    defs = _module_defs(path)
    fixtures = set(fixtures)
    for name in (function, *sorted(fixtures & defs.keys())):
        if name in defs:
            found |= _literals(defs[name], known, params)
    if "nocache_reference" in fixtures:
        found.add("nocache")
    return tuple(sorted(found))


def _flatten(schedule: Sequence[Sequence[str]]) -> list[str]:
    return [name for names in schedule for name in names]


def evict(live: Sequence[str], future: Sequence[Sequence[str]]) -> str:
    """The live configuration to stop: the one whose next use in ``future`` (the tests still to
    run, in order, the current one first) is farthest away; one never used again goes first, and
    among equals the least recently used (``live`` is least recently used first)."""
    nxt = {name: NEVER for name in live}
    for i, names in enumerate(future):
        for name in names:
            if nxt.get(name) == NEVER:
                nxt[name] = i
    return _victim(live, nxt)


def _victim(live: Sequence[str], next_use: dict[str, int]) -> str:
    """Belady's choice among ``live`` (least recently used first): the farthest ``next_use``,
    ties to the least recently used."""
    return max(live, key=lambda name: (next_use[name], -live.index(name)))


def server_starts(schedule: Sequence[Sequence[str]], slots: int) -> int:
    """Server starts for tests asking for ``schedule`` (per test, the configurations it uses, in
    run order) with at most ``slots`` alive and ``evict`` choosing which to stop."""
    flat = _flatten(schedule)
    next_use = [NEVER] * len(flat)
    seen: dict[str, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], NEVER)
        seen[flat[i]] = i
    live: dict[str, int] = {}  # configuration -> its next use; insertion order = least recently used first
    starts = 0
    for i, name in enumerate(flat):
        if name not in live:
            starts += 1
            if len(live) >= slots:
                del live[_victim(list(live), live)]  # evict()'s rule, next uses precomputed
        live.pop(name, None)
        live[name] = next_use[i]
    return starts


def order_modules(
    modules: dict[str, list[tuple[str, ...]]], slots: int, seed: int = 0, rounds: int = 3000
) -> list[str]:
    """Module names (keys of ``modules``: per module, its tests' predicted configurations in file
    order) in the order that needs the fewest ``server_starts``.

    Modules that use no server keep their order and run first. The others start in file order
    and are improved by moving one module at a time to another place (seeded; a move that does not
    add starts is kept, so ties drift towards other orders of equal cost). On the default tier
    (2026-12-07) 3,000 moves take 0.2 s and find an order of 22 predicted starts for its 21
    configurations, against 27 in file order with the same eviction and 38 in file order with
    the least recently used stopped."""
    quiet = [m for m, tests in modules.items() if not any(tests)]
    busy = [m for m, tests in modules.items() if any(tests)]

    def cost(order: list[str]) -> int:
        return server_starts([t for m in order for t in modules[m]], slots)

    best, best_cost = busy, cost(busy)
    rng = random.Random(seed)
    for _ in range(rounds if len(busy) > 1 else 0):
        cand = list(best)
        i, j = rng.sample(range(len(cand)), 2)
        cand.insert(j, cand.pop(i))
        c = cost(cand)
        if c <= best_cost:
            best, best_cost = cand, c
    return quiet + best
