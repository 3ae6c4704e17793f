"""Start and stop real ``sglang_k3.launch_server`` processes for the tests.

The implementation is shared with the live A/B benchmark: ``benchmarks/live/server.py``."""

from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.live.server import Server, ServerStartError, free_port  # noqa: E402,F401


def k3_state(server) -> dict:
    """The k3 cache's counters and sizes as ``/server_info`` reports them (its first scheduler)."""
    import requests

    r = requests.get(server.url + "/server_info", timeout=60)
    r.raise_for_status()
    return r.json()["internal_states"][0]["k3_cache"]
