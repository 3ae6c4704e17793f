"""Start a local fleet: a mooncake_master, N ``sglang_k3.launch_server`` instances on the embedded
model sharing it as their L3 tier, and sglang-router in front; Ctrl-C stops everything.

    python scripts/start_fleet.py --instances 3 --router-port 30000 [options] [-- launch_server flags]

Send requests to the router. A request carrying the header ``X-SMG-Routing-Key: <session id>``
goes to its session's primary instance (the router's ``consistent_hashing`` policy, the default
here); when the primary is down, to its secondary. Every instance writes the checkpoints and MLA
pages it computes through to the shared Mooncake store, held by a standalone store client
(``--store-segment``), so a session that moves still hits, even when it moved because its instance
died.

Each instance admits prompts per length class (``--admission-thresholds``, default 2048: a burst
of long prompts holds at most half of an instance's prefill capacity). While it runs, the fleet's
status is printed every ``--status-interval`` seconds; ``python -m sglang_k3.fleet.status
--router URL`` prints it on demand.

A disaggregated fleet (``--pd``): prefill instances with the k3 cache, decode instances, and the
router in PD mode; each request's MLA KV and KDA state cross from prefill to decode over Mooncake's
transfer engine (TCP by default), and with the shared L3 each finished turn's state and answer come
back from decode through it, so the next turn's prefill restores them:

    python scripts/start_fleet.py --pd --prefill 1 --decode 1 --router-port 30000 [-- launch_server flags]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_k3.fleet.local_fleet import DEFAULT_SEGMENT_BYTES, DEFAULT_STORE_BYTES, FleetSpec, LocalFleet  # noqa: E402
from sglang_k3.fleet.router_process import POLICIES  # noqa: E402
from sglang_k3.fleet.status import fleet_status, format_table  # noqa: E402
from sglang_k3.process_group import exit_on_stop_signals  # noqa: E402
from sglang_k3.tiers.mooncake_master import size_arg  # noqa: E402
from sglang_k3.tiers.system_deps import MissingDependency, store_client_class  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=2, help="number of sglang_k3 instances (default 2)")
    ap.add_argument("--router-port", type=int, default=30000, help="the router's port (default 30000)")
    ap.add_argument(
        "--policy",
        choices=POLICIES,
        default="consistent_hashing",
        help="the router's policy (default consistent_hashing: sessions by X-SMG-Routing-Key, a primary and "
        "a secondary; cache_aware is the router's own default)",
    )
    ap.add_argument(
        "--no-shared-l3",
        action="store_true",
        help="no mooncake_master: instances keep only their own device cache",
    )
    ap.add_argument(
        "--store-segment",
        default=f"{DEFAULT_STORE_BYTES >> 20}mb",
        help="the Mooncake pool, held by a standalone store client so states outlive the instances that "
        "wrote them (default %(default)s; 0: the instances hold the pool, --segment each)",
    )
    ap.add_argument(
        "--segment",
        default=f"{DEFAULT_SEGMENT_BYTES >> 20}mb",
        help="with --store-segment 0: memory each instance contributes to the pool (default %(default)s)",
    )
    ap.add_argument(
        "--admission-thresholds",
        type=int,
        nargs="*",
        default=[2048],
        metavar="TOKENS",
        help="prompt lengths splitting requests into admission classes (default 2048; none: budgets off); "
        "passed to every instance as --k3-admission-thresholds",
    )
    ap.add_argument(
        "--admission-shares",
        type=float,
        nargs="*",
        default=[],
        metavar="SHARE",
        help="each class's share of an instance's prefill capacity (default 1.0 for the shortest, 0.5 for "
        "the others); --k3-admission-shares",
    )
    ap.add_argument(
        "--pd",
        action="store_true",
        help="a disaggregated fleet (SGLang's --disaggregation-mode): --prefill instances compute prompts "
        "with the k3 cache and hand each request's MLA KV and KDA state to --decode instances over "
        "Mooncake's transfer engine; the router runs with --pd-disaggregation. With the shared L3 (unless "
        "--no-shared-l3) decode writes each finished turn's state and answer through to it, and the next "
        "turn's prefill restores them",
    )
    ap.add_argument("--prefill", type=int, default=1, help="with --pd: prefill instances (default 1)")
    ap.add_argument("--decode", type=int, default=1, help="with --pd: decode instances (default 1)")
    ap.add_argument(
        "--pd-backend",
        choices=("mooncake_tcp", "mooncake"),
        default="mooncake_tcp",
        help="with --pd: SGLang's --disaggregation-transfer-backend (default mooncake_tcp: TCP, no RDMA "
        "needed; mooncake uses RDMA where there is some)",
    )
    ap.add_argument("--log-dir", default=None, help="where the processes log (default: the temp directory)")
    ap.add_argument(
        "--status-interval",
        type=float,
        default=60.0,
        help="print the fleet's status every this many seconds (default 60; 0: never)",
    )
    ap.add_argument("instance_args", nargs=argparse.REMAINDER, help="after --: flags for every launch_server")
    return ap


def spec_from_args(args: argparse.Namespace, ap: argparse.ArgumentParser) -> FleetSpec:
    if args.instances < 1:
        ap.error("--instances must be >= 1")
    if args.pd and (args.prefill < 1 or args.decode < 1):
        ap.error("--pd needs --prefill and --decode of at least 1")
    if not (0 < args.router_port < 65536):
        ap.error("--router-port must be a TCP port")
    if args.status_interval < 0:
        ap.error("--status-interval must be >= 0")
    seg = size_arg(ap, "--segment", args.segment, at_least="16mb")
    store = size_arg(ap, "--store-segment", args.store_segment, at_least="16mb", zero_ok=True, example="1gb, 0")
    if args.admission_shares and not args.admission_thresholds:
        ap.error("--admission-shares needs --admission-thresholds")
    extra = list(args.instance_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    adm: list[str] = []
    if args.admission_thresholds:
        adm = ["--k3-admission-thresholds", *map(str, args.admission_thresholds)]
        if args.admission_shares:
            adm += ["--k3-admission-shares", *map(str, args.admission_shares)]
    return FleetSpec(
        instances=args.instances,
        policy=args.policy,
        router_port=args.router_port,
        shared_l3=not args.no_shared_l3,
        segment_bytes=seg,
        store_segment_bytes=store,
        instance_args=tuple(adm + extra),
        log_dir=args.log_dir,
        prefill=args.prefill if args.pd else 0,
        decode=args.decode if args.pd else 0,
        pd_backend=args.pd_backend,
    )


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    spec = spec_from_args(args, ap)
    if spec.shared_l3 or spec.pd:
        # Before anything starts: the instances' --k3-mooncake and the store holder load the same
        # client library the master's binary needs (sglang_k3/tiers/system_deps.py).
        try:
            store_client_class("start_fleet.py --pd" if spec.pd else "start_fleet.py")
        except MissingDependency as e:
            hint = "" if spec.pd else "\n(--no-shared-l3 starts the fleet without the shared Mooncake L3)"
            print(f"error: {e}{hint}", file=sys.stderr)
            return 1
    fleet = LocalFleet(spec)
    exit_on_stop_signals()  # SIGTERM and Ctrl-C run the finally below
    try:
        fleet.start()
        print(f"fleet ready: send requests to {fleet.url} (header X-SMG-Routing-Key: <session id>)", flush=True)
        print(f"status: python -m sglang_k3.fleet.status --router {fleet.url}", flush=True)
        last = time.time()
        while True:
            time.sleep(1.0)
            dead = [srv.name for srv in fleet.instances if not srv.alive()]
            if fleet.router is None or not fleet.router.alive():
                print("the router exited; stopping the fleet", file=sys.stderr)
                return 1
            if args.status_interval and time.time() - last >= args.status_interval:
                last = time.time()
                print(format_table(fleet_status(fleet.url)), flush=True)
                if dead:
                    print(f"instances down: {', '.join(dead)}", flush=True)
    except KeyboardInterrupt:
        return 0
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        print("stopping the fleet ...", file=sys.stderr, flush=True)
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
