"""Start and stop real ``sglang_k3.launch_server`` processes for the tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process; ``url`` is its base URL once ``start()`` returned."""

    def __init__(self, name: str, args: list[str], start_timeout: float = 600.0):
        self.name, self.args, self.start_timeout = name, list(args), start_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"sglang_k3_test_{name}_{self.port}.log")
        self.start_seconds: float | None = None

    def start(self) -> "Server":
        cmd = [sys.executable, "-m", "sglang_k3.launch_server", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "w")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.time() - t0 < self.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    self.start_seconds = time.time() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server {self.name} not healthy in {self.start_timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        self._log.close()

    # --- requests -------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        body.update(extra)
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()
