"""Hit rate at equal host bytes: k3's host tier against SGLang's HiCache, on the trace replay.

    python -m benchmarks.hicache_equal_bytes [--members conversation,docs] [--budgets-gib 10,40]
        [--host-gib 50,200] [--out benchmarks/results/hicache_equal_bytes]

For each member trace (the retention suite's: the shipped conversation trace, 4,000 requests, and
the docs family, seed 1, 3,000 requests), each device budget and each host size, one replay of
three policies at their defaults: ``k3`` with ``--host-budget-gib H`` (its host tier, int8 states,
parking by default), ``upstream-hicache`` with the same ``H`` (SGLang 0.5.23's HiCache at its
default write-through policy, fp32 states, host pools split as the device's:
``benchmarks/policies/upstream_hicache.py`` cites each rule), and ``upstream`` without a host tier
(the device alone). Chunked prefill 8192. Writes OUT/results.json (every record), OUT/README.md (the
table) and OUT/hicache_equal_bytes.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks import suite, trace_replay

POLICIES = ("k3", "upstream-hicache", "upstream")


def _csv_numbers(s: str) -> list[float]:
    out = [float(x) for x in s.split(",") if x.strip()]
    return [int(x) if x.is_integer() else x for x in out]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.hicache_equal_bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--members", default="conversation,docs", help="suite members (default: %(default)s)")
    ap.add_argument("--budgets-gib", default="10,40", help="device budgets (default: %(default)s)")
    ap.add_argument("--host-gib", default="50,200", help="host bytes of both tiers (default: %(default)s)")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--conversation-requests", type=int, default=4000)
    ap.add_argument("--requests", type=int, default=3000, help="requests of the docs member (default: 3000)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(suite.REPO, "benchmarks", "results", "hicache_equal_bytes"))
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    members = [m for m in a.members.split(",") if m]
    bad = [m for m in members if m not in suite.MEMBERS]
    if bad:
        raise SystemExit(f"error: unknown member {bad}; choose from {', '.join(suite.MEMBERS)}")
    try:
        budgets, hosts = _csv_numbers(a.budgets_gib), _csv_numbers(a.host_gib)
    except ValueError:
        raise SystemExit("error: --budgets-gib and --host-gib take comma-separated numbers") from None
    if not hosts or any(h <= 0 for h in hosts):
        raise SystemExit("error: --host-gib needs positive sizes (the comparison is of host tiers)")
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="hicache_equal_bytes_")
    a.fork_requests = 0  # suite._trace reads it for the fork members only
    records = []
    for m in members:
        path = suite._trace(m, work, a)
        for h in hosts:
            run_out = os.path.join(work, f"{m}_host{h}")
            print(f"== {m}, host {h} GiB", file=sys.stderr, flush=True)
            rc = trace_replay.main(
                [
                    "--trace", path,
                    "--policies", ",".join(POLICIES),
                    "--budgets-gib", ",".join(map(str, budgets)),
                    "--host-budget-gib", str(h),
                    "--chunked-prefill-size", str(a.chunked_prefill_size),
                    "--model-config", "kimi-linear-48b",
                    "--jobs", str(a.jobs),
                    "--out", run_out,
                ]
            )  # fmt: skip
            if rc:
                raise SystemExit(f"error: the replay of {m} at host {h} GiB failed ({rc})")
            with open(os.path.join(run_out, "results.json")) as f:
                res = json.load(f)
            for r in res:
                if r["policy"] in POLICIES:
                    records.append({"member": m, "host_gib": h, **r})
    rows = _rows(records)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"command": "python -m benchmarks.hicache_equal_bytes " + " ".join(argv or sys.argv[1:]),
                   "rows": rows, "records": records}, f, indent=1)  # fmt: skip
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(_table(rows))
    _plot(rows, os.path.join(a.out, "hicache_equal_bytes.png"))
    print(_table(rows))
    return 0


def _rows(records: list[dict]) -> list[dict]:
    by = {(r["member"], r["host_gib"], r["budget_gib"], r["policy"]): r for r in records}
    rows = []
    for m, h, b in sorted({(r["member"], r["host_gib"], r["budget_gib"]) for r in records}):
        k3, hc, up = (by[(m, h, b, p)] for p in POLICIES)
        rows.append(
            {
                "member": m,
                "host_gib": h,
                "device_gib": b,
                "k3": k3["hit_rate"],
                "upstream_hicache": hc["hit_rate"],
                "upstream_device_only": up["hit_rate"],
                "k3_over_hicache": k3["hit_rate"] / hc["hit_rate"] if hc["hit_rate"] else None,
                "k3_oracle_fraction": k3["oracle_fraction"],
                "hicache_oracle_fraction": hc["oracle_fraction"],
                "hicache_host_state_gib": hc["host_tier"]["host_state_bytes"] / (1 << 30),
                "hicache_host_kv_gib": hc["host_tier"]["host_kv_bytes"] / (1 << 30),
            }
        )
    return rows


def _table(rows: list[dict]) -> str:
    out = [
        "# Hit rate at equal host bytes: k3's host tier against SGLang's HiCache (trace replay)\n",
        "`python -m benchmarks.hicache_equal_bytes`; Kimi-Linear-48B sizes, chunk 8192, every policy at its"
        " defaults (k3: int8 states, parking; HiCache: write-through, fp32 states, host pools split as the"
        " device's).\n",
        "| member | host GiB | device GiB | k3 | upstream + HiCache | upstream, device only | k3 / HiCache |"
        " k3 of oracle | HiCache of oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["k3_over_hicache"] is None else f"{r['k3_over_hicache']:.2f}x"
        out.append(
            f"| {r['member']} | {r['host_gib']} | {r['device_gib']} | {r['k3']:.3f} | {r['upstream_hicache']:.3f} |"
            f" {r['upstream_device_only']:.3f} | {ratio} | {r['k3_oracle_fraction']:.3f} |"
            f" {r['hicache_oracle_fraction']:.3f} |"
        )
    return "\n".join(out) + "\n"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members = sorted({r["member"] for r in rows})
    fig, axes = plt.subplots(1, len(members), figsize=(5.5 * len(members), 4), squeeze=False)
    for ax, m in zip(axes[0], members):
        for h in sorted({r["host_gib"] for r in rows if r["member"] == m}):
            rs = sorted((r for r in rows if r["member"] == m and r["host_gib"] == h), key=lambda r: r["device_gib"])
            xs = [r["device_gib"] for r in rs]
            ax.plot(xs, [r["k3"] for r in rs], marker="o", label=f"k3, host {h} GiB")
            ax.plot(xs, [r["upstream_hicache"] for r in rs], marker="^", ls="--", label=f"HiCache, host {h} GiB")
        dev = {r["device_gib"]: r["upstream_device_only"] for r in rows if r["member"] == m}
        xs = sorted(dev)
        ax.plot(xs, [dev[b] for b in xs], marker="s", ls=":", color="gray", label="upstream, device only")
        ax.set_title(m)
        ax.set_xlabel("device budget (GiB)")
        ax.set_ylabel("token hit rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
