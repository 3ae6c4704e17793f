"""What the live harnesses that compare a few servers write: one bar panel per metric, and the
results folder (``results.json``, the PNG, a README with the table)."""

from __future__ import annotations

import json
import os


def bar_panel(ax, names: list[str], ys: list[float], colors: dict, title: str) -> None:
    """One metric across servers: a bar per server, its value on top."""
    bars = ax.bar(names, ys, color=[colors[n] for n in names])
    for b, y in zip(bars, ys):
        ax.annotate(f"{y:.3g}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=7)


def write_report(out: str, stem: str, result: dict, heading: str, caption: str, table: str) -> None:
    """``out/results.json`` (``result``) and ``out/README.md``: ``heading``, the command and
    ``caption``, ``table``, and the plot ``out/<stem>.png`` (drawn by the caller)."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"# {heading}\n\n")
        f.write(f"`python -m benchmarks.{stem}`; {caption}.\n\n")
        f.write(table + f"\n\n![{stem}]({stem}.png)\n")
