"""``python -m sglang_k3.fleet.status --router URL``: one line per instance behind a router.

Per instance it shows:

- ``healthy`` and ``rt_load``: the router's own view (``GET /workers``; its load is its count of
  requests in flight, kept only under ``cache_aware`` and ``manual``);
- ``run``/``wait`` and ``kv_use``: the instance's scheduler load (SGLang's ``GET /v1/loads``);
- ``hit dev/host/l3``: the share of looked-up prompt tokens restored from each tier (the k3
  cache's counters in ``GET /server_info``: a tier's share is the tokens its loads added past the
  device's own restore point; the device's share is the rest of the hits);
- ``sessions``: session keys (``X-SMG-Routing-Key``) it served in the last ``--window-s`` seconds,
  and admission waits, from ``GET /k3_fleet_info``.

``--json`` prints the same as JSON. An instance that does not answer is shown as down.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

import requests


def _get(url: str, params: Optional[dict] = None, timeout: float = 5.0) -> Optional[Any]:
    try:
        r = requests.get(url, params=params, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def tier_hit_rates(k3: dict) -> dict:
    """Shares of looked-up tokens restored per tier, from a ``k3_cache`` snapshot."""
    req = k3.get("requested_tokens", 0)
    host, l3 = k3.get("tier_host_hit_tokens", 0), k3.get("tier_l3_hit_tokens", 0)
    dev = k3.get("hit_tokens", 0) - host - l3
    if not req:
        return {"device": 0.0, "host": 0.0, "l3": 0.0, "total": 0.0, "requested_tokens": 0}
    return {
        "device": dev / req,
        "host": host / req,
        "l3": l3 / req,
        "total": k3.get("hit_tokens", 0) / req,
        "requested_tokens": req,
    }


def instance_status(url: str, window_s: float) -> dict:
    out: dict[str, Any] = {"url": url}
    info = _get(url + "/server_info")
    if info is None:
        out["up"] = False
        return out
    out["up"] = True
    k3 = (info.get("internal_states") or [{}])[0].get("k3_cache")
    out["hit_rates"] = tier_hit_rates(k3) if k3 else None
    loads = _get(url + "/v1/loads")
    if loads and loads.get("loads"):
        ld = loads["loads"][0]
        out["load"] = {k: ld.get(k) for k in ("num_running_reqs", "num_waiting_reqs", "token_usage")}
    fi = _get(url + "/k3_fleet_info", {"window_s": window_s})
    if fi is not None:
        out["sessions_held"] = fi["sessions_held"]
        out["admission"] = fi["admission"]
    return out


def fleet_status(router_url: str, window_s: float = 1800.0) -> dict:
    r = requests.get(router_url.rstrip("/") + "/workers", timeout=10)
    r.raise_for_status()
    rows = []
    for w in r.json().get("workers", []):
        st = instance_status(w["url"], window_s)
        st["router_healthy"] = bool(w.get("is_healthy"))
        st["router_load"] = w.get("load")
        rows.append(st)
    return {"router": router_url, "instances": rows}


def format_table(status: dict) -> str:
    head = f"{'instance':<26} {'healthy':>7} {'rt_load':>7} {'run':>4} {'wait':>4} {'kv_use':>6} "
    head += f"{'hit dev/host/l3':>17} {'sessions':>8} {'adm_waits':>9}"
    lines = [f"router {status['router']}", head]
    for st in status["instances"]:
        if not st.get("up"):
            lines.append(f"{st['url']:<26} {'down':>7}")
            continue
        ld = st.get("load") or {}
        h = st.get("hit_rates")
        hits = f"{h['device']:.2f}/{h['host']:.2f}/{h['l3']:.2f}" if h else "-"
        adm = st.get("admission")
        waits = sum(c["waited"] for c in adm["classes"]) if adm else "-"
        lines.append(
            f"{st['url']:<26} {('yes' if st['router_healthy'] else 'no'):>7} {str(st['router_load']):>7} "
            f"{ld.get('num_running_reqs', '-'):>4} {ld.get('num_waiting_reqs', '-'):>4} "
            f"{(ld.get('token_usage') or 0):>6.2f} {hits:>17} {st.get('sessions_held', '-'):>8} {waits:>9}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_k3.fleet.status",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--router", required=True, help="the router's base URL, e.g. http://127.0.0.1:30000")
    ap.add_argument(
        "--window-s", type=float, default=1800.0, help="sessions seen within this many seconds (default 1800)"
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.window_s <= 0:
        ap.error("--window-s must be > 0")
    try:
        status = fleet_status(args.router, args.window_s)
    except requests.RequestException as e:
        print(f"error: the router at {args.router} did not answer GET /workers: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
