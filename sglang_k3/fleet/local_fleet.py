"""A local fleet: one ``mooncake_master``, N ``sglang_k3.launch_server`` instances sharing it as
their L3 tier, and sglang-router in front. ``scripts/start_fleet.py``, the fleet tests and the
fleet benchmark all start it through :class:`LocalFleet`.

With ``prefill`` and ``decode`` set, the fleet is disaggregated instead (SGLang's
``--disaggregation-mode``): prefill instances, each with its own bootstrap port, hand every
request's MLA KV and KDA state to a decode instance over Mooncake's transfer engine
(``pd_backend``; ``mooncake_tcp`` runs without RDMA), and the router runs with
``--pd-disaggregation``. The k3 cache serves on the prefill side (hits are reported there). With
the shared L3 (the default) the decode side runs a k3 cache too
(``--disaggregation-decode-enable-radix-cache``) that writes every finished turn's boundary (its
state and the KV of the tokens it generated) through to Mooncake, where the next turn's prefill,
on any prefill instance, restores it instead of recomputing the answer; without it, SGLang runs the
decode side with no prefix cache and the previous answer is prefilled again.

By default the pool's memory is held by a standalone store client (``tiers/store_holder.py``), so a
state outlives the instance that wrote it; with ``store_segment_bytes=0`` the instances hold it.
Every process runs in its own process group and :meth:`LocalFleet.stop` stops them in reverse
order (router, instances, store holder, master), so nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Optional

import requests

from sglang_k3.fleet.instance import Server, free_port
from sglang_k3.fleet.instance_info import INFO_PATH
from sglang_k3.fleet.router_process import RouterProcess

# What every instance runs with unless the spec says otherwise: the shared L3 with
# write_through, so a boundary one instance stores is in Mooncake at once and another instance
# restores it on its next request (not only after the first one evicts it).
SHARED_L3_ARGS = ("--k3-mooncake", "--k3-tier-write-policy", "write_through")
DEFAULT_SEGMENT_BYTES = 256 << 20  # each instance's share of the Mooncake pool (store_segment_bytes=0)
DEFAULT_STORE_BYTES = 1 << 30  # the pool, held by a standalone store client (tiers/store_holder.py)


def cpu_threads_env(instances: int) -> dict[str, str]:
    """Split this machine's cores between the instances (``OMP_NUM_THREADS``), unless the user
    set it. Every instance's scheduler otherwise runs one OpenMP thread per core, and on a CPU
    fleet of 3 instances on 2 cores their spinning threads cut decode to about a tenth of a fair
    share (measured in benchmarks/fleet_ab.py: 1.2 output tokens/s per instance)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // instances))}


@dataclasses.dataclass
class FleetSpec:
    instances: int = 2
    policy: str = "consistent_hashing"
    router_port: Optional[int] = None
    shared_l3: bool = True
    # The pool's memory: a standalone store client holding this much (objects outlive the
    # instances, as on a production pool of memory servers); 0: each instance contributes
    # segment_bytes instead (an instance that dies takes its objects with it).
    store_segment_bytes: int = DEFAULT_STORE_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    instance_args: tuple[str, ...] = ()  # every instance's launch_server flags
    router_args: tuple[str, ...] = ()  # extra router flags
    log_dir: Optional[str] = None
    prefill: int = 0  # with decode: a disaggregated fleet of this many prefill instances
    decode: int = 0  # ... and this many decode instances (``instances`` is then unused)
    pd_backend: str = "mooncake_tcp"  # SGLang's --disaggregation-transfer-backend

    @property
    def pd(self) -> bool:
        return bool(self.prefill or self.decode)

    def __post_init__(self) -> None:
        if self.pd:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError(
                    f"a disaggregated fleet needs at least 1 prefill and 1 decode instance "
                    f"(got {self.prefill} and {self.decode})"
                )
        elif self.instances < 1:
            raise ValueError(f"a fleet needs at least 1 instance (got {self.instances})")
        if self.segment_bytes < 16 << 20:
            raise ValueError("each instance's Mooncake segment must be at least 16 MiB")
        if self.store_segment_bytes and self.store_segment_bytes < 16 << 20:
            raise ValueError("the store holder's segment must be at least 16 MiB (0: the instances hold the pool)")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LocalFleet:
    def __init__(self, spec: FleetSpec, progress: Callable[[str], None] = _say):
        self.spec, self.progress = spec, progress
        self.master = None
        self.holder = None
        self.instances: list[Server] = []
        self.router: Optional[RouterProcess] = None
        self.bootstrap_ports: dict[str, int] = {}  # prefill instance name -> its bootstrap port

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
        s = self.spec
        env = cpu_threads_env(s.prefill + s.decode if s.pd else s.instances)
        args = list(s.instance_args)
        if s.shared_l3:
            from sglang_k3.tiers.mooncake_master import MooncakeMaster

            self.master = MooncakeMaster(log_path=None).start()
            self.progress(f"fleet: mooncake_master on {self.master.master_address}")
            if s.store_segment_bytes:
                from sglang_k3.tiers.store_holder import StoreHolderProcess

                self.holder = StoreHolderProcess(self.master, s.store_segment_bytes, s.log_dir).start()
                self.progress(f"fleet: a store client holds the pool ({s.store_segment_bytes >> 20} MiB)")
            env.update(self.master.client_env(0 if s.store_segment_bytes else s.segment_bytes))
            args = list(SHARED_L3_ARGS) + args
        if s.pd:
            self.instances = self._pd_instances(args, env)
        else:
            self.instances = [
                Server(f"fleet{i}", args, env=env or None, log_dir=s.log_dir, log_prefix="sglang_k3_fleet")
                for i in range(s.instances)
            ]
        for srv in self.instances:
            srv.launch()
        self.progress(f"fleet: starting {len(self.instances)} instances (logs {self.instances[0].log_path} ...)")
        for srv in self.instances:
            srv.wait_healthy()
            self.progress(f"fleet: instance {srv.name} healthy at {srv.url} after {srv.start_seconds:.0f}s")
        self.start_router(s.policy)

    def _pd_instances(self, args: list[str], env: dict) -> list[Server]:
        """Prefill instances (each with a bootstrap port the router passes on to decode), then
        decode instances."""
        s = self.spec
        backend = ["--disaggregation-transfer-backend", s.pd_backend]
        out = []
        self.bootstrap_ports = {}
        for i in range(s.prefill):
            port = free_port()
            role = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port), *backend]
            srv = Server(f"prefill{i}", args + role, env=env or None, log_dir=s.log_dir, log_prefix="sglang_k3_fleet")
            self.bootstrap_ports[srv.name] = port
            out.append(srv)
        # with the shared L3, decode keeps a k3 cache that writes each turn's end through to it
        hand_back = ["--disaggregation-decode-enable-radix-cache"] if s.shared_l3 else []
        for i in range(s.decode):
            role = ["--disaggregation-mode", "decode", *backend, *hand_back]
            out.append(
                Server(f"decode{i}", args + role, env=env or None, log_dir=s.log_dir, log_prefix="sglang_k3_fleet")
            )
        return out

    def start_router(self, policy: str, urls: Optional[list[str]] = None) -> RouterProcess:
        """(Re)start the router with ``policy`` in front of ``urls`` (default: every live instance)."""
        if self.router is not None:
            self.router.stop()
        urls = urls or [srv.url for srv in self.instances if srv.alive()]
        pd = None
        if self.spec.pd:
            by_url = {srv.url: srv for srv in self.instances}
            prefill = [
                (u, self.bootstrap_ports[by_url[u].name]) for u in urls if by_url[u].name in self.bootstrap_ports
            ]
            pd = (prefill, [u for u in urls if by_url[u].name not in self.bootstrap_ports])
        self.router = RouterProcess(
            urls, policy, port=self.spec.router_port, extra_args=self.spec.router_args, log_dir=self.spec.log_dir, pd=pd
        ).start()
        self.progress(f"fleet: router ({policy}) on {self.router.url} in front of {len(urls)} instances")
        return self.router

    def session_keys(self, timeout: float = 60) -> dict[str, set[str]]:
        """Per live instance (by URL), the session keys (``X-SMG-Routing-Key``) it was sent, as
        the instance itself lists them (``GET /k3_fleet_info?list_keys=true``)."""
        out = {}
        for srv in self.instances:
            if srv.alive():
                info = requests.get(srv.url + INFO_PATH, params={"list_keys": True}, timeout=timeout).json()
                out[srv.url] = set(info["session_keys"])
        return out

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for srv in self.instances:
            srv.stop()
        if self.holder is not None:
            self.holder.stop()
            self.holder = None
        if self.master is not None:
            self.master.stop()
            self.master = None

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
