"""Every entry point that starts a Mooncake master or client names a missing system library and the
command that installs it (``sglang_k3/tiers/system_deps.py``), tested with libibverbs really hidden
from the dynamic loader.

The library is hidden in a private mount namespace: an overlay over its directory whose upper layer
holds a whiteout for the soname, so the loader finds nothing (``unshare -m``, as root). The
processes run inside it are the real scripts and the real Mooncake binaries; nothing else on the
machine sees the change.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_k3.tiers.system_deps import install_command, missing_library

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SONAME = "libibverbs.so.1"
FIX = "apt-get install -y libibverbs1"


def test_loader_messages_name_the_library():
    # ld.so's message for a binary, and the ImportError Python raises for an extension module.
    binary = "mooncake_master: error while loading shared libraries: libibverbs.so.1: cannot open shared object file"
    assert missing_library(binary) == SONAME
    assert missing_library("libnuma.so.1: cannot open shared object file: No such file or directory") == "libnuma.so.1"
    assert missing_library("mooncake_master exited: address already in use") is None
    assert install_command(SONAME) == FIX
    assert "libfoo.so.3" in install_command("libfoo.so.3") and "apt-get install" not in install_command("libfoo.so.3")


def _library_dir(soname: str) -> str | None:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(soname + " ") and "=>" in line:
            return os.path.dirname(os.path.realpath(line.split("=>", 1)[1].strip()))
    return None


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    """A command prefix that runs its command with ``SONAME`` hidden from the loader."""
    pytest.importorskip("mooncake")  # the wheel; its loading is what is under test
    if os.geteuid() != 0:
        pytest.skip("hiding a library needs root (a private mount namespace and an overlay)")
    libdir = _library_dir(SONAME)
    if libdir is None:
        pytest.skip(f"{SONAME} is not installed, so it cannot be hidden ({FIX})")
    work = tmp_path_factory.mktemp("hide")
    upper, scratch = work / "upper", work / "work"
    upper.mkdir()
    scratch.mkdir()
    os.mknod(upper / SONAME, 0o600 | 0o020000, os.makedev(0, 0))  # an overlay whiteout
    mount = f"mount -t overlay overlay -o lowerdir={libdir},upperdir={upper},workdir={scratch} {libdir}"
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount + ' && exec "$@"', "sh"]
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", f"import ctypes; ctypes.CDLL({SONAME!r})"], capture_output=True, text=True
    )
    if probe.returncode == 0 or SONAME not in probe.stderr:
        pytest.skip(f"could not hide {SONAME} here: {probe.stderr.strip()[-300:]}")
    return prefix


def _run(prefix, *args, timeout=120):
    return subprocess.run([*prefix, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _assert_named(proc, what):
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr
    assert f"error: {what} cannot start" in err, err[-2000:]
    assert SONAME in err and FIX in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


def test_start_mooncake_master(hidden):
    # The master binary alone: its loader error is read from its log.
    _assert_named(_run(hidden, sys.executable, "scripts/start_mooncake_master.py"), "mooncake_master")


def test_start_mooncake_master_client(hidden):
    proc = _run(hidden, sys.executable, "scripts/start_mooncake_master.py", "--client", "--segment", "64mb")
    _assert_named(proc, "start_mooncake_master.py --client")


def test_start_fleet(hidden):
    # Refused before any process starts; --no-shared-l3 needs no Mooncake.
    proc = _run(hidden, sys.executable, "scripts/start_fleet.py", "--instances", "1", "--router-port", "39171")
    _assert_named(proc, "start_fleet.py")
    assert "--no-shared-l3" in proc.stderr


def test_launch_server_k3_mooncake(hidden):
    # Before SGLang starts its scheduler (which would load the client in a child process).
    proc = _run(hidden, sys.executable, "-m", "sglang_k3.launch_server", "--k3-mooncake", "--model-path", REPO)
    _assert_named(proc, "launch_server --k3-mooncake")


def test_store_holder(hidden):
    args = ["--master", "127.0.0.1:1", "--metadata-url", "http://127.0.0.1:2/metadata", "--segment", "64mb"]
    _assert_named(_run(hidden, sys.executable, "-m", "sglang_k3.tiers.store_holder", *args), "the store holder")


def test_master_helper_raises_the_fix(hidden):
    # The helper the tests, benchmarks and LocalFleet use raises MissingDependency, not a bare exit code.
    code = (
        "from sglang_k3.tiers.mooncake_master import MooncakeMaster\n"
        "from sglang_k3.tiers.system_deps import MissingDependency\n"
        "try:\n    MooncakeMaster().start()\nexcept MissingDependency as e:\n"
        "    print(e.missing, '|', e.fix)\n    raise SystemExit(3)\n"
    )
    proc = _run(hidden, sys.executable, "-c", code)
    assert proc.returncode == 3, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.strip() == f"the system library {SONAME} | {FIX}"
