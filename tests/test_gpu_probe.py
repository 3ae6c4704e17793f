"""``benchmarks.gpu_probe`` (the GPU driver's ``probe`` phase): its flags and how it reads a server log.
Its servers run on the lent GPU (benchmarks/GPU_NOTES.md); the same harness against a CPU server is
what ``tests/test_noise_differential.py`` and ``tests/test_live_ab.py`` do for theirs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import gpu_probe


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--server-args", "x", "--out", "o"], "at least one --config"),
        (["--server-args", "x", "--out", "o", "--config", "noequals"], "NAME=ARGS"),
        (["--server-args", "x", "--out", "o", "--config", "a=", "--env", "b:X=1"], "NAME one of a"),
        (["--server-args", "x", "--out", "o", "--config", "a=", "--conversations", "0"], "must be >= 1"),
    ],
)
def test_bad_flags_are_refused_before_any_server(args, msg):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_probe", *args], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_configs_and_envs_are_parsed_per_name():
    argv = ["--server-args", "--x 1", "--out", "o", "--config", "big=--mem 0.12 --y", "--config", "small="]
    a = gpu_probe.parse_args([*argv, "--env", "big:A=1"])
    assert a.configs == {"big": ["--mem", "0.12", "--y"], "small": []}
    assert a.envs == {"big": {"A": "1"}, "small": {}}


def test_first_error_names_what_failed_and_the_error(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "[t] Ignore import error when loading x: No module named 'deep_gemm'\n"
        "[2026-12-04 15:08:07] Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "scheduler.py", line 1, in run\n'
        "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered\n"
    )
    got = gpu_probe.first_error(str(log))
    assert got.splitlines()[0].endswith("Scheduler hit an exception: Traceback (most recent call last):")
    assert "illegal memory access" in got.splitlines()[1]
    log.write_text("[t] ready\n")
    assert gpu_probe.first_error(str(log)) is None
    assert gpu_probe.first_error(str(tmp_path / "missing.log")) is None
