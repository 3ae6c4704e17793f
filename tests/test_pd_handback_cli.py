"""``python -m benchmarks.pd_handback``: its help and clear errors for bad flags. The deployments it
compares are exercised end to end by tests/test_pd_fleet.py (a real PD fleet with the hand-back),
so this test does not start them again."""

from __future__ import annotations

import functools

from server_utils import run_benchmark

_run = functools.partial(run_benchmark, "benchmarks.pd_handback")


def test_help_names_the_three_deployments_and_bad_flags_fail_with_the_reason():
    r = _run(["--help"])
    assert r.returncode == 0
    for needle in ("single", "pd_handback", "--server-args", "--conversations", "Mooncake"):
        assert needle in r.stdout, needle
    for bad, needle in (
        (["--only", "pd,nope"], "--only"),
        (["--turns", "0"], "--turns"),
        (["--reply-len", "0"], "--reply-len"),
    ):
        r = _run(bad)
        assert r.returncode == 2 and needle in r.stderr, (bad, r.stderr)
