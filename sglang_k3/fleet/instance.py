"""Start and stop real ``sglang_k3.launch_server`` processes (the fleet launcher, the live A/B and
the tests).

A server runs in its own process group (so stopping it also stops SGLang's scheduler and detokenizer
children), logs to a file, and is healthy once ``GET /health`` answers 200. A failed start raises
with the tail of that log.

A start that fails only because a port was taken between the moment it was picked and the moment a
process bound it (the handle's HTTP port, or the rendezvous port SGLang picks for its scheduler:
servers booting at once can pick the same one) is retried on fresh ports, ``port_retries`` times.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import Optional

import requests

from sglang_k3.process_group import GroupProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def k3_state(url: str, timeout: float = 60.0) -> dict:
    """The k3 cache's counters and sizes as ``GET /server_info`` reports them (its first
    scheduler's ``internal_states``); raises when the server does not answer or runs another cache."""
    r = requests.get(url + "/server_info", timeout=timeout)
    r.raise_for_status()
    return r.json()["internal_states"][0]["k3_cache"]


def flush_cache(url: str, attempts: int = 30, name: str = "") -> None:
    """``POST /flush_cache``; SGLang refuses while requests are in flight, so retry briefly."""
    last = ""
    for _ in range(attempts):
        r = requests.post(url + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        last = f"{r.status_code} {r.text[:200]}"
        time.sleep(1.0)
    raise RuntimeError(f"{name or url}: /flush_cache kept failing: {last}")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message holds its log tail."""


# What a start that lost a port race prints: torch's TCPStore and uvicorn ("[Errno 98] ... address
# already in use") and SGLang's launcher ("Port is already in use", server_args.PortArgs.init_new).
PORT_CLASH_MARKERS = ("address already in use", "port is already in use")


def log_shows_port_clash(log_path: str) -> bool:
    """Whether a server's log says it could not bind a port (anywhere in it: the line can sit
    above a long traceback of what failed next)."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read().lower()
    except OSError:
        return False
    return any(m in text for m in PORT_CLASH_MARKERS)


class Server(GroupProcess):
    """One server process; ``url`` is its base URL once ``start()`` returned.

    ``launch()`` + ``wait_healthy()`` split ``start()`` so several servers can boot at once."""

    def __init__(
        self,
        name: str,
        args: list[str],
        start_timeout: float = 600.0,
        log_dir: Optional[str] = None,
        log_prefix: str = "sglang_k3_test",
        env: Optional[dict] = None,
        port_retries: int = 2,
    ):
        self.name, self.args, self.start_timeout = name, list(args), start_timeout
        self._log_dir, self._log_prefix = log_dir or tempfile.gettempdir(), log_prefix
        self._use_port(free_port())
        self.env = env
        self.port_retries = port_retries
        self.port_clashes = 0  # starts retried because a port was taken
        self.start_seconds: float | None = None
        self._t0 = 0.0

    def _use_port(self, port: int, attempt: int = 0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        retry = f"_retry{attempt}" if attempt else ""
        self.log_path = os.path.join(self._log_dir, f"{self._log_prefix}_{self.name}_{port}{retry}.log")

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang_k3.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def launch(self) -> "Server":
        self._t0 = time.time()
        self.spawn(self.command, env=None if self.env is None else {**os.environ, **self.env})
        return self

    def wait_healthy(self) -> "Server":
        """Wait for ``/health``; ``start_timeout`` counts from :meth:`launch` (servers launched
        together boot together)."""

        def healthy() -> bool:
            try:
                return requests.get(self.url + "/health", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        what = f"server {self.name}"
        while True:
            try:
                self.wait_until(healthy, self.start_timeout, 1.0, what, error=ServerStartError, since=self._t0)
                break
            except ServerStartError:
                if self.port_clashes >= self.port_retries or not log_shows_port_clash(self.log_path):
                    raise
                self.port_clashes += 1
                print(
                    f"server {self.name}: a port was taken during start (log {self.log_path}); "
                    f"retrying on fresh ports ({self.port_clashes}/{self.port_retries})",
                    file=sys.stderr,
                    flush=True,
                )
                self._use_port(free_port(), self.port_clashes)
                self.launch()
        self.start_seconds = time.time() - self._t0
        return self

    def start(self) -> "Server":
        return self.launch().wait_healthy()

    # --- requests -------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        body = {"input_ids": input_ids, "sampling_params": params}
        body.update(extra)
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def flush_cache(self, attempts: int = 30) -> None:
        flush_cache(self.url, attempts, name=f"server {self.name}")
