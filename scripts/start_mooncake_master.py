"""Start a local mooncake_master (with its HTTP metadata server) and print the environment that
points ``sglang_k3.launch_server --k3-mooncake`` at it; Ctrl-C stops it.

    python scripts/start_mooncake_master.py [--rpc-port P] [--metadata-port Q] [--metrics-port R]
        [--segment 4gb] [--client]

With ``--client`` it also runs a standalone store client that contributes ``--segment`` of memory to
the pool, so that objects outlive the server instances (give the servers
MOONCAKE_GLOBAL_SEGMENT_SIZE=0 then).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_k3.process_group import exit_on_stop_signals  # noqa: E402
from sglang_k3.tiers.mooncake_master import MooncakeMaster, size_arg  # noqa: E402
from sglang_k3.tiers.system_deps import MissingDependency, store_client_class  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rpc-port", type=int, default=None, help="master RPC port (default: a free one)")
    ap.add_argument("--metadata-port", type=int, default=None, help="HTTP metadata server port (default: free)")
    ap.add_argument("--metrics-port", type=int, default=None, help="master metrics port (default: free)")
    ap.add_argument("--segment", default="4gb", help="segment size for --client and the printed env (default 4gb)")
    ap.add_argument("--client", action="store_true", help="also hold a standalone store client's segment")
    ap.add_argument("--log", default=None, help="master log file (default /tmp/mooncake_master_<port>.log)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    seg = size_arg(ap, "--segment", args.segment, example="4gb, 512mb")
    try:
        store_class = store_client_class("start_mooncake_master.py --client") if args.client else None
        master = MooncakeMaster(args.rpc_port, args.metadata_port, args.metrics_port, args.log).start()
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    client = None
    try:
        if store_class is not None:
            client = store_class()
            rc = client.setup("127.0.0.1", master.metadata_url, seg, 16 << 20, "tcp", "", master.master_address)
            if rc != 0:
                print(f"error: the standalone store client's setup failed ({rc})", file=sys.stderr)
                return 1
        env = master.client_env(0 if args.client else seg)
        print(f"mooncake_master on {master.master_address} (log {master.log_path})", flush=True)
        if client is not None:
            print(f"standalone store client holds {args.segment} of the pool", flush=True)
        print("for sglang_k3.launch_server --k3-mooncake:")
        for k, v in env.items():
            print(f"export {k}={v!r}" if v else f"export {k}=''")
        sys.stdout.flush()
        exit_on_stop_signals()
        while master.alive():
            time.sleep(1)
        print("mooncake_master exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if client is not None:
            client.close()
        master.stop()


if __name__ == "__main__":
    sys.exit(main())
