"""Start and stop a real sglang-router (``python -m sglang_k3.fleet.launch_router``) in front of
running instances.

``FAILOVER_ARGS`` are the router settings a fleet of sessions needs, each one the router's own
flag (sglang-router 0.3.2 defaults in brackets):

- ``--health-check-interval-secs 2 --health-failure-threshold 2`` [60, 3]: a dead worker (its
  port refuses connections) is marked unhealthy in about 4 s instead of about 3 minutes. Until
  then, ``consistent_hashing`` keeps sending its keys there: the ring skips only unavailable
  workers.
- ``--health-check-timeout-secs 25`` [5]: SGLang's ``/health`` generates one token and waits up to
  20 s (``SGLANG_HEALTH_CHECK_TIMEOUT``) for the scheduler to answer; a busy CPU instance takes
  more than 5 s, and with the default the router marked live instances unhealthy and moved their
  sessions (seen in this repository's fleet test).
- ``--retry-max-retries 8 --retry-initial-backoff-ms 200 --retry-backoff-multiplier 2
  --retry-max-backoff-ms 3000`` [5, 50, 1.5, 30000]: a request that hits the dead worker (a
  connection error is a retryable 500) is retried for about 12 s, past that detection, and each
  retry selects the worker again, so it lands on the key's secondary. With the defaults the
  retries are spent in about 0.4 s, before the worker is known to be down.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional, Sequence

import requests

from sglang_k3.fleet.instance import free_port
from sglang_k3.process_group import GroupProcess

FAILOVER_ARGS: tuple[str, ...] = (
    "--health-check-interval-secs", "2",
    "--health-failure-threshold", "2",
    "--health-check-timeout-secs", "25",
    "--retry-max-retries", "8",
    "--retry-initial-backoff-ms", "200",
    "--retry-backoff-multiplier", "2",
    "--retry-max-backoff-ms", "3000",
)  # fmt: skip
# A disaggregated fleet on a few CPU cores: a prefill instance answers /health only between long
# prefills (SGLang's health request queues behind them), so the router waits longer before it
# marks one unhealthy. Given after FAILOVER_ARGS' 25 s, which it overrides (the router's argparse
# keeps the last value).
PD_ARGS: tuple[str, ...] = ("--health-check-timeout-secs", "60")
POLICIES = ("round_robin", "cache_aware", "consistent_hashing", "power_of_two", "random", "manual")


class RouterStartError(RuntimeError):
    """The router exited or did not see every worker healthy in time; the message holds its log tail."""


class RouterProcess(GroupProcess):
    term_timeout = 20.0

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str = "cache_aware",
        port: Optional[int] = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        failover: bool = True,
        log_dir: Optional[str] = None,
        pd: Optional[tuple[Sequence[tuple[str, int]], Sequence[str]]] = None,
    ):
        """``pd``: ``(prefill (url, bootstrap port) pairs, decode urls)`` runs the router with
        ``--pd-disaggregation`` in front of them (``worker_urls`` then lists them all)."""
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.worker_urls, self.policy, self.host = list(worker_urls), policy, host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.pd = pd
        self.extra_args = list(extra_args) + (list(FAILOVER_ARGS) if failover else []) + (list(PD_ARGS) if pd else [])
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"sglang_k3_router_{self.port}.log")

    @property
    def command(self) -> list[str]:
        if self.pd is None:
            workers = ["--worker-urls", *self.worker_urls]
        else:
            prefill, decode = self.pd
            workers = ["--pd-disaggregation"]
            for url, bootstrap in prefill:
                workers += ["--prefill", url, str(bootstrap)]
            for url in decode:
                workers += ["--decode", url]
        return [
            sys.executable, "-m", "sglang_k3.fleet.launch_router",
            "--host", self.host, "--port", str(self.port),
            *workers,
            "--policy", self.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 120.0) -> "RouterProcess":
        self.spawn(self.command)
        self.wait_until(self._all_workers_healthy, timeout, 0.5, "router", RouterStartError)
        return self

    def _all_workers_healthy(self) -> bool:
        try:
            ws = self.workers()
        except (requests.RequestException, ValueError):
            return False
        return len(ws) == len(self.worker_urls) and all(w.get("is_healthy") for w in ws)

    def workers(self) -> list[dict]:
        """The router's own view (``GET /workers``): url, is_healthy, load (its in-flight count)."""
        r = requests.get(self.url + "/workers", timeout=10)
        r.raise_for_status()
        return r.json().get("workers", [])

    def healthy_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}
