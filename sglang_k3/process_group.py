"""Stopping a child started with ``start_new_session=True`` together with everything it started
(SGLang's scheduler and detokenizer processes, a master's threads): SIGTERM to its process group,
SIGKILL if it is not gone in time. Used by the fleet's server and router handles
(:class:`GroupProcess`) and the Mooncake master helper, so none of them leaves orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional


def exit_on_stop_signals() -> None:
    """For a long-running helper that cleans up in ``finally`` / ``except KeyboardInterrupt``:
    SIGTERM exits through ``sys.exit(0)``, and SIGINT (Ctrl-C, ``kill -INT``) raises
    KeyboardInterrupt even when the process started with SIGINT ignored, as a shell job or
    ``nohup`` starts it (Python installs its own SIGINT handler only if SIGINT was not ignored)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_group(proc: subprocess.Popen, term_timeout: float = 30.0, kill: bool = False) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(timeout=term_timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


class GroupProcess:
    """A child in its own process group that logs to ``log_path``: the part the fleet's server
    and router handles share. Subclasses set ``log_path`` and call :meth:`spawn`."""

    log_path: str
    proc: Optional[subprocess.Popen] = None
    _log = None
    term_timeout: float = 30.0

    def spawn(self, command: list[str], env: Optional[dict] = None) -> subprocess.Popen:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (held open for the process's lifetime)
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        return self.proc

    def wait_until(
        self,
        ready: Callable[[], bool],
        timeout: float,
        interval: float,
        what: str,
        error=RuntimeError,
        since: Optional[float] = None,
    ) -> None:
        """Poll ``ready()`` every ``interval`` s until it is true. If the process exits first, or
        ``timeout`` passes (counted from ``since``, a ``time.time()``; default now), stop it and
        raise ``error`` naming ``what``, with the log's tail."""
        deadline = (time.time() if since is None else since) + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                tail = self.log_tail()
                self.stop()
                raise error(f"{what} exited with {code} (log {self.log_path}):\n{tail}")
            if ready():
                return
            time.sleep(interval)
        tail = self.log_tail()
        self.stop()
        raise error(f"{what} not ready in {timeout}s (log {self.log_path}):\n{tail}")

    def log_tail(self, n: int = 60, width: int = 400) -> str:
        """The last ``n`` lines of the log, each cut to ``width`` characters (SGLang logs all its
        server args on one very long line)."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.readlines()[-n:]
            return "".join(ln if len(ln) <= width else ln[:width] + " ...\n" for ln in lines)
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the whole process group (SIGTERM, then SIGKILL); idempotent."""
        if self.proc is None:
            return
        stop_group(self.proc, term_timeout=self.term_timeout)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
