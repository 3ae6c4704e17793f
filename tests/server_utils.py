"""Start and stop real ``sglang_k3.launch_server`` processes for the tests.

The implementation is shared with the live A/B benchmark: ``benchmarks/live/server.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.live.server import Server, ServerStartError, free_port  # noqa: E402,F401
from sglang_k3.fleet.instance import k3_state as _k3_state_at  # noqa: E402


def k3_state(server) -> dict:
    """The k3 cache's counters and sizes as ``/server_info`` reports them (its first scheduler)."""
    return _k3_state_at(server.url)


def run_benchmark(module: str, args: list, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` from the repository root with its output captured: how the
    tests run a benchmark's command line (its help, its errors, a small end-to-end run)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=_REPO, capture_output=True, text=True, timeout=timeout
    )


def check_cli(module: str, needles=(), refusals=(), parser=None, timeout: float = 120.0) -> str:
    """A benchmark's command line as a user meets it: ``--help`` exits 0 and names every
    ``needles`` entry (and, given its ``parser``, every option with a help text of its own), and
    each ``(args, needle)`` of ``refusals`` is refused before any server starts (exit 2, the flag
    named in the error). Returns the help text."""
    r = run_benchmark(module, ["--help"], timeout)
    assert r.returncode == 0, r.stderr
    for needle in needles:
        assert needle in r.stdout, needle
    if parser is not None:
        actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert actions
        for a in actions:
            assert a.help and a.option_strings[0] in r.stdout, a.option_strings
    for args, needle in refusals:
        bad = run_benchmark(module, list(args), timeout)
        assert bad.returncode == 2 and needle in bad.stderr, (args, bad.stderr)
    return r.stdout


def abort_all_mid_flight(server, prompts: list, max_new_tokens: int, after_s: float) -> list:
    """Send every prompt at once (greedy, one thread each), abort them all through
    ``/abort_request`` ``after_s`` seconds later, wait for every request to come back. Returns each
    request's response, or the exception it raised (an aborted request may come back as an error)."""
    import requests

    results: list = [None] * len(prompts)

    def run(i):
        try:
            results[i] = server.generate(prompts[i], max_new_tokens)
        except Exception as e:  # recorded for the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(after_s)
    requests.post(server.url + "/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request did not come back after the abort"
    return results


def abort_variants_mid_flight(server, prompt: list, max_new_tokens: int, after_s: float = 2.0) -> None:
    """Four requests extending ``prompt`` by one token each, sent at once and aborted mid-flight
    (:func:`abort_all_mid_flight`); asserts one came back aborted and, within 30 s, that the k3
    cache tracks no request."""
    results = abort_all_mid_flight(server, [prompt + [i + 3] for i in range(4)], max_new_tokens, after_s)
    reasons = [r["meta_info"]["finish_reason"]["type"] for r in results if isinstance(r, dict)]
    assert "abort" in reasons, reasons
    assert wait_untracked(server)["tracked_requests"] == 0


def wait_untracked(server, timeout: float = 30.0, poll: float = 0.5) -> dict:
    """Poll the k3 cache's state until it tracks no request or ``timeout`` seconds pass; returns
    the last state read (the caller asserts on it)."""
    deadline = time.time() + timeout
    state = k3_state(server)
    while state["tracked_requests"] and time.time() < deadline:
        time.sleep(poll)
        state = k3_state(server)
    return state
