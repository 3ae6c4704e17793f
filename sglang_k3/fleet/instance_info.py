"""What one server tells the fleet: ``GET /k3_fleet_info``.

- **Sessions held.** The router's session key is the ``X-SMG-Routing-Key`` request header; the
  router forwards it to the worker it picks. A middleware notes each key and when it was last
  seen; ``sessions_held`` counts the keys seen in the last ``window_s`` seconds (query parameter,
  default 1800).
- **Admission budgets** (``--k3-admission-thresholds``): per class, budget, tokens in flight,
  requests waiting, and how long they waited.

The cache's own counters (hit rates per tier) stay in ``/server_info``; ``sglang_k3.fleet.status``
joins the two per instance.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Optional

ROUTING_KEY_HEADER = "x-smg-routing-key"  # sglang-router's session key (src/routers/header_utils.rs)
DEFAULT_WINDOW_S = 1800.0
INFO_PATH = "/k3_fleet_info"


class SessionsSeen:
    """Routing keys and when each was last seen, least recently seen first, at most ``max_keys``."""

    def __init__(self, max_keys: int = 100_000, clock: Callable[[], float] = time.time):
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys, self.clock = max_keys, clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.requests_with_key = 0

    def note(self, key: str) -> None:
        self.requests_with_key += 1
        self._seen[key] = self.clock()
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)

    def held(self, window_s: float) -> int:
        cutoff = self.clock() - window_s
        n = 0
        for t in reversed(self._seen.values()):  # most recent first
            if t < cutoff:
                break
            n += 1
        return n

    def keys(self, window_s: float) -> list[str]:
        cutoff = self.clock() - window_s
        return [k for k, t in self._seen.items() if t >= cutoff]


def install(app: Any, sessions: SessionsSeen, admission: Callable[[], Optional[Any]]) -> None:
    """Add the session-key middleware and ``GET /k3_fleet_info`` to SGLang's FastAPI ``app``.
    ``admission`` returns the server's :class:`~sglang_k3.fleet.admission.AdmissionControl` or None."""
    from fastapi import Request

    @app.middleware("http")
    async def _note_session(request: Request, call_next):
        key = request.headers.get(ROUTING_KEY_HEADER)
        if key:
            sessions.note(key)
        return await call_next(request)

    async def fleet_info(window_s: float = DEFAULT_WINDOW_S, list_keys: bool = False) -> dict:
        ctl = admission()
        out = {
            "sessions_held": sessions.held(window_s),
            "session_window_s": window_s,
            "requests_with_session_key": sessions.requests_with_key,
            "admission": None if ctl is None else ctl.stats(),
        }
        if list_keys:
            out["session_keys"] = sessions.keys(window_s)
        return out

    app.add_api_route(INFO_PATH, fleet_info, methods=["GET"])
