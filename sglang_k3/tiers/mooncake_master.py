"""Start and stop a local ``mooncake_master`` (with its HTTP metadata server) on free loopback
ports, and the environment that points SGLang-style Mooncake clients at it. Used by
``scripts/start_mooncake_master.py``, the tests and the benchmarks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Optional

from sglang_k3.process_group import stop_group
from sglang_k3.tiers.system_deps import (
    WHEEL_FIX,
    MissingDependency,
    raise_if_missing_library,
    store_client_class,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_size(s: str) -> int:
    """A size as the scripts take it: ``4gb``, ``512mb``, ``64kb``, ``100b`` or plain bytes.
    Raises ``ValueError`` for anything else."""
    s = s.strip().lower()
    for suffix, mult in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("b", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def size_arg(
    ap, flag: str, value: str, *, at_least: str = "", zero_ok: bool = False, example: str = "256mb, 1gb"
) -> int:
    """``value`` of the size flag ``flag`` in bytes, or ``ap.error`` saying why not: not a size, or
    under ``at_least`` (``zero_ok``: 0, meaning off, is allowed too). The scripts' one check."""
    try:
        n = parse_size(value)
    except ValueError:
        ap.error(f"{flag}: not a size: {value!r} (e.g. {example})")
    if at_least and n < parse_size(at_least) and not (zero_ok and n == 0):
        ap.error(f"{flag} must be {'0 or ' if zero_ok else ''}at least {at_least}")
    return n


class MooncakeMaster:
    def __init__(
        self,
        rpc_port: Optional[int] = None,
        metadata_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        log_path: Optional[str] = None,
        extra_args: Optional[list[str]] = None,
    ) -> None:
        exe = shutil.which("mooncake_master")
        if exe is None:
            raise MissingDependency("mooncake_master", "the mooncake_master command (the Mooncake wheel)", WHEEL_FIX)
        self.exe = exe
        self.rpc_port = rpc_port or free_port()
        self.metadata_port = metadata_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_path = log_path or os.path.join("/tmp", f"mooncake_master_{self.rpc_port}.log")
        self.extra_args = list(extra_args or [])
        self.proc: Optional[subprocess.Popen] = None

    @property
    def command(self) -> list[str]:
        return [
            self.exe,
            "--rpc_port",
            str(self.rpc_port),
            "--rpc_address",
            "127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host",
            "127.0.0.1",
            "--http_metadata_server_port",
            str(self.metadata_port),
            "--metrics_port",
            str(self.metrics_port),
            *self.extra_args,
        ]

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def client_env(self, segment_bytes: int = 256 << 20) -> dict[str, str]:
        """SGLang's Mooncake variables for a client of this master over TCP on loopback (SGLang
        reads MOONCAKE_GLOBAL_SEGMENT_SIZE as bytes or as whole "<n>gb")."""
        segment = str(int(segment_bytes))
        return {
            "MOONCAKE_MASTER": self.master_address,
            "MOONCAKE_TE_META_DATA_SERVER": self.metadata_url,
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": segment,
            "MOONCAKE_DEVICE": "",
        }

    def start(self, timeout: float = 30.0) -> "MooncakeMaster":
        log = open(self.log_path, "w")  # noqa: SIM115 (handed to the process)
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                self._raise_exited()
            try:
                with (
                    socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5),
                    socket.create_connection(("127.0.0.1", self.metadata_port), timeout=0.5),
                ):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master not listening after {timeout}s; log {self.log_path}")

    def _raise_exited(self) -> None:
        """The master exited before it listened: :class:`MissingDependency` when its log has the
        loader's message for a missing system library, else a RuntimeError with the log's end."""
        rc = self.proc.returncode
        try:
            with open(self.log_path, errors="replace") as f:
                log = f.read()
        except OSError:
            log = ""
        raise_if_missing_library("mooncake_master", log)
        tail = " | ".join(log.strip().splitlines()[-3:])
        raise RuntimeError(f"mooncake_master exited with {rc}; log {self.log_path}" + (f": {tail}" if tail else ""))

    def clear(self, lease_wait_s: float = 6.0) -> int:
        """Remove every object from the pool (between benchmark runs), through a short-lived
        client of this master that contributes no memory of its own. Returns the count removed
        (Mooncake's ``remove_all``; negative: its error code). An object read in the last few
        seconds holds a lease (the master's ``default_kv_lease_ttl``, 5 s) and is skipped, so a
        second pass runs after ``lease_wait_s``."""
        client = store_client_class("a client of the Mooncake master")()
        rc = client.setup("127.0.0.1", self.metadata_url, 0, 16 << 20, "tcp", "", self.master_address)
        if rc != 0:
            raise RuntimeError(f"a Mooncake client of {self.master_address} failed to set up ({rc})")
        try:
            n = int(client.remove_all())
            if lease_wait_s > 0:
                time.sleep(lease_wait_s)
                n += max(0, int(client.remove_all()))
            return n
        finally:
            client.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        stop_group(self.proc, term_timeout=20, kill=kill)
        self.proc = None
