"""Start and stop real ``sglang_k3.launch_server`` processes for the tests.

The implementation is shared with the live A/B benchmark: ``benchmarks/live/server.py``."""

from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.live.server import Server, ServerStartError, free_port  # noqa: E402,F401
from sglang_k3.fleet.instance import k3_state as _k3_state_at  # noqa: E402


def k3_state(server) -> dict:
    """The k3 cache's counters and sizes as ``/server_info`` reports them (its first scheduler)."""
    return _k3_state_at(server.url)
