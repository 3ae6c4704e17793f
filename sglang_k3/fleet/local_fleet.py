"""A local fleet: one ``mooncake_master``, N ``sglang_k3.launch_server`` instances sharing it as
their L3 tier, and sglang-router in front. ``scripts/start_fleet.py``, the fleet tests and the
fleet benchmark all start it through :class:`LocalFleet`.

Every process runs in its own process group and :meth:`LocalFleet.stop` stops them in reverse
order (router, instances, master), so nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

from sglang_k3.fleet.instance import Server
from sglang_k3.fleet.router_process import RouterProcess

# What every instance runs with unless the spec says otherwise: the shared L3 with
# write_through, so a boundary one instance stores is in Mooncake at once and another instance
# restores it on its next request (not only after the first one evicts it).
SHARED_L3_ARGS = ("--k3-mooncake", "--k3-tier-write-policy", "write_through")
DEFAULT_SEGMENT_BYTES = 256 << 20  # each instance's share of the Mooncake pool


@dataclasses.dataclass
class FleetSpec:
    instances: int = 2
    policy: str = "consistent_hashing"
    router_port: Optional[int] = None
    shared_l3: bool = True
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    instance_args: tuple[str, ...] = ()  # every instance's launch_server flags
    router_args: tuple[str, ...] = ()  # extra router flags
    log_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"a fleet needs at least 1 instance (got {self.instances})")
        if self.segment_bytes < 16 << 20:
            raise ValueError("each instance's Mooncake segment must be at least 16 MiB")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LocalFleet:
    def __init__(self, spec: FleetSpec, progress: Callable[[str], None] = _say):
        self.spec, self.progress = spec, progress
        self.master = None
        self.instances: list[Server] = []
        self.router: Optional[RouterProcess] = None

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("the fleet's router is not running")
        return self.router.url

    def start(self) -> "LocalFleet":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        s, env = self.spec, None
        args = list(s.instance_args)
        if s.shared_l3:
            from sglang_k3.tiers.mooncake_master import MooncakeMaster

            self.master = MooncakeMaster(log_path=None).start()
            env = self.master.client_env(s.segment_bytes)
            args = list(SHARED_L3_ARGS) + args
            self.progress(f"fleet: mooncake_master on {self.master.master_address}")
        self.instances = [
            Server(f"fleet{i}", args, env=env, log_dir=s.log_dir, log_prefix="sglang_k3_fleet")
            for i in range(s.instances)
        ]
        for srv in self.instances:
            srv.launch()
        self.progress(f"fleet: starting {s.instances} instances (logs {self.instances[0].log_path} ...)")
        for srv in self.instances:
            srv.wait_healthy()
            self.progress(f"fleet: instance {srv.name} healthy at {srv.url} after {srv.start_seconds:.0f}s")
        self.start_router(s.policy)

    def start_router(self, policy: str, urls: Optional[list[str]] = None) -> RouterProcess:
        """(Re)start the router with ``policy`` in front of ``urls`` (default: every live instance)."""
        if self.router is not None:
            self.router.stop()
        urls = urls or [srv.url for srv in self.instances if srv.alive()]
        self.router = RouterProcess(
            urls, policy, port=self.spec.router_port, extra_args=self.spec.router_args, log_dir=self.spec.log_dir
        ).start()
        self.progress(f"fleet: router ({policy}) on {self.router.url} in front of {len(urls)} instances")
        return self.router

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for srv in self.instances:
            srv.stop()
        if self.master is not None:
            self.master.stop()
            self.master = None

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
