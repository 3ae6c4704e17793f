"""The soak's command line: it explains itself and refuses nonsense before starting servers."""

from __future__ import annotations

import functools

from server_utils import run_benchmark

_run = functools.partial(run_benchmark, "benchmarks.soak")


def test_help_names_every_flag():
    r = _run(["--help"])
    assert r.returncode == 0
    for flag in ("--seeds", "--start-seed", "--rounds", "--k3-args", "--server-args", "--matrix", "--out"):
        assert flag in r.stdout


def test_bad_seed_count_is_refused():
    r = _run(["--seeds", "0"])
    assert r.returncode == 2 and "--seeds and --rounds must be >= 1" in r.stderr


def test_the_matrix_is_every_combination_and_each_is_a_server_launch_server_accepts():
    import shlex

    from benchmarks.soak import MATRIX
    from sglang_k3 import launch_server as L

    seen = set()
    for k3_args in MATRIX.values():
        argv, cfg = L.build_argv(["--model-path", "/m", *shlex.split(k3_args)])
        page = int(argv[argv.index("--page-size") + 1])
        seen.add((page, cfg.checkpoint_dtype, "--disable-overlap-schedule" in argv))
    assert seen == {(p, d, off) for p in (1, 64) for d in ("fp32", "int8") for off in (False, True)}
