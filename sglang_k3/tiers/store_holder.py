"""``python -m sglang_k3.tiers.store_holder``: a standalone Mooncake store client that holds a
segment of the pool and nothing else, so objects outlive the instances that wrote them.

Objects live in the memory of the client whose segment the master put them in. When instances
contribute the pool's memory (``MOONCAKE_GLOBAL_SEGMENT_SIZE`` > 0), an instance that dies takes
its segment's objects with it: its sessions, moved to other instances, find their states gone. In
production the pool lives on memory servers; locally this process plays that part (the instances
then run with ``MOONCAKE_GLOBAL_SEGMENT_SIZE=0``). It prints ``ready`` once its segment is mounted
and runs until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from sglang_k3.process_group import GroupProcess, exit_on_stop_signals
from sglang_k3.tiers.system_deps import MissingDependency, raise_if_missing_library, store_client_class


class StoreHolderProcess(GroupProcess):
    """This module run as a child process (in its own process group), for :class:`LocalFleet`
    (``sglang_k3.fleet.local_fleet``) and the tests."""

    term_timeout = 10.0

    def __init__(self, master, segment_bytes: int, log_dir=None):
        self.master, self.segment_bytes = master, int(segment_bytes)
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"sglang_k3_store_holder_{master.rpc_port}.log")

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "sglang_k3.tiers.store_holder",
            "--master", self.master.master_address, "--metadata-url", self.master.metadata_url,
            "--segment", str(self.segment_bytes),
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> "StoreHolderProcess":
        self.spawn(self.command)
        try:
            self.wait_until(self._mounted, timeout, 0.2, "the store holder")
        except RuntimeError as e:
            raise_if_missing_library("the store holder", str(e))
            raise
        return self

    def _mounted(self) -> bool:
        with open(self.log_path, errors="replace") as f:
            return any(line.startswith("ready:") for line in f)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_k3.tiers.store_holder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--master", required=True, help="the master's RPC address, host:port")
    ap.add_argument("--metadata-url", required=True, help="the HTTP metadata server, http://host:port/metadata")
    ap.add_argument("--segment", required=True, help="memory to hold, e.g. 1gb or 536870912")
    ap.add_argument("--hostname", default="127.0.0.1", help="this client's address (default 127.0.0.1)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from sglang_k3.tiers.mooncake_master import size_arg

    seg = size_arg(ap, "--segment", args.segment, at_least="16mb")
    try:
        client = store_client_class("the store holder")()
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rc = client.setup(args.hostname, args.metadata_url, seg, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        print(f"error: the store client's setup against {args.master} failed ({rc})", file=sys.stderr)
        return 1
    exit_on_stop_signals()
    print(f"ready: holding {seg} bytes of the pool of {args.master}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
