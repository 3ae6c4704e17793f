"""Stopping a child started with ``start_new_session=True`` together with everything it started
(SGLang's scheduler and detokenizer processes, a master's threads): SIGTERM to its process group,
SIGKILL if it is not gone in time. Used by the test and benchmark servers and the Mooncake master
helper, so none of them leaves orphans."""

from __future__ import annotations

import os
import signal
import subprocess


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
