"""``python -m sglang_k3.fleet.launch_router``: sglang-router's own launcher, with its
``consistent_hashing`` policy selectable (session affinity with a primary and a secondary).

sglang-router 0.3.2 implements ``consistent_hashing`` (``src/policies/consistent_hashing.rs``) and
its Python binding maps the name (``sglang_router/router.py::policy_from_str``), but its CLI offers
only ``random, round_robin, cache_aware, power_of_two, manual`` (``router_args.py``, the
``--policy`` choices). This launcher builds the router's own argument parser
(``RouterArgs.add_cli_args``), adds ``consistent_hashing`` to the choices of ``--policy``, and starts
the router with the router's own ``launch_router``. Everything else is the router's, unchanged.

What ``consistent_hashing`` does (read from the 0.3.2 source): a request's ``X-SMG-Routing-Key``
header is hashed (blake3) onto a ring holding 150 virtual nodes per worker
(``src/core/worker_registry.rs::HashRing``); the request goes to the first available worker
clockwise: the key's primary, and when that one is unhealthy or its circuit breaker is open, the
next one, its secondary. Because every worker has 150 points on the ring, the secondaries of one
worker's keys spread over all the others. A request without the header is routed by a hash of its
``Authorization``, ``X-Forwarded-For`` or ``Cookie`` header, else at random.
"""

from __future__ import annotations

import argparse
import sys

SESSION_POLICY = "consistent_hashing"


def build_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(
        prog="python -m sglang_k3.fleet.launch_router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    for action in parser._actions:
        if "--policy" in action.option_strings:
            action.choices = list(action.choices) + [SESSION_POLICY]
            action.help = (
                f"{action.help}. '{SESSION_POLICY}' (added by sglang-k3): sessions by the "
                "X-SMG-Routing-Key header, a primary and a secondary on a hash ring"
            )
    return parser


def parse(argv: list[str]):
    from sglang_router.router_args import RouterArgs

    return RouterArgs.from_cli_args(build_parser().parse_args(argv), use_router_prefix=False)


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router

    launch_router(parse(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
