"""The soak's command line: it explains itself and refuses nonsense before starting servers."""

from __future__ import annotations

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.soak", *args], capture_output=True, text=True, timeout=120)


def test_help_names_every_flag():
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--seeds", "--start-seed", "--rounds", "--k3-args", "--server-args", "--out"):
        assert flag in r.stdout


def test_bad_seed_count_is_refused():
    r = _run("--seeds", "0")
    assert r.returncode == 2 and "--seeds and --rounds must be >= 1" in r.stderr
