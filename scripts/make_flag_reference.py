"""Write ``docs/flags.md``, the flag reference, from the argparse definitions themselves.

    python scripts/make_flag_reference.py           # rewrite docs/flags.md
    python scripts/make_flag_reference.py --check   # exit 1 if docs/flags.md is out of date

Each command's parser is the one it runs with (``add_k3_args`` for ``launch_server``, each script's
``build_parser``), so the reference cannot drift from ``--help``: ``tests/test_flag_reference.py``
fails when the file and the parsers disagree.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
OUT = os.path.join(REPO, "docs", "flags.md")

HEADER = """# Flag reference

Generated from the argparse definitions by `python scripts/make_flag_reference.py`; do not edit by
hand (`tests/test_flag_reference.py` fails when this file and the parsers disagree). The user guide
([user_guide.md](user_guide.md)) says when to use which.
"""


def _k3_parser() -> argparse.ArgumentParser:
    from sglang_k3.integration.k3_args import add_k3_args

    p = argparse.ArgumentParser(prog="python -m sglang_k3.launch_server", add_help=False)
    add_k3_args(p)
    return p


def _script_parser(name: str):
    def build() -> argparse.ArgumentParser:
        spec = importlib.util.spec_from_file_location(f"_flagref_{name}", os.path.join(REPO, "scripts", name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.build_parser()

    return build


def _module_parser(module: str):
    def build() -> argparse.ArgumentParser:
        return importlib.import_module(module).build_parser()

    return build


# (command, what it is, the parser it runs with)
COMMANDS = [
    (
        "python -m sglang_k3.launch_server",
        "SGLang's server with the k3 cache. These are the flags sglang-k3 adds; every "
        "`sglang.launch_server` flag is passed through unchanged (`--help` lists ours first, then SGLang's).",
        _k3_parser,
    ),
    (
        "python scripts/start_fleet.py",
        "A local fleet: a `mooncake_master`, a store client holding the shared pool, N instances and "
        "sglang-router in front. Ctrl-C stops everything.",
        _script_parser("start_fleet"),
    ),
    (
        "python scripts/start_mooncake_master.py",
        "A local `mooncake_master` (and optionally a store client holding the pool); prints the "
        "environment for `launch_server --k3-mooncake`.",
        _script_parser("start_mooncake_master"),
    ),
    (
        "python -m sglang_k3.fleet.status",
        "One line per instance behind a router: health, load, hits per tier, sessions, admission waits.",
        _module_parser("sglang_k3.fleet.status"),
    ),
    (
        "python -m sglang_k3.tiers.store_holder",
        "A standalone Mooncake store client that holds a segment of the pool (started by `start_fleet.py`).",
        _module_parser("sglang_k3.tiers.store_holder"),
    ),
]


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`-- {action.dest.upper()}...`" if action.nargs == argparse.REMAINDER else f"`{action.dest}`"
    name = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{name}`"
    if action.choices is not None:
        arg = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        arg = action.metavar or action.dest.upper()
    if action.nargs in ("+", "*"):
        arg = f"{arg} [{arg} ...]"
    return f"`{name} {arg}`"


def _default_cell(action: argparse.Action) -> str:
    if action.nargs == argparse.REMAINDER:
        return "none"
    if action.required:
        return "required"
    d = action.default
    if action.nargs == 0:
        return "off" if d is False else str(d)
    if d is None or d == argparse.SUPPRESS:
        return "-"
    if isinstance(d, (list, tuple)):
        return " ".join(f"`{x}`" for x in d) if d else "none"
    return f"`{d}`"


def _help_cell(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    out = [HEADER]
    for command, what, build in COMMANDS:
        parser = build()
        out += [f"## `{command}`", "", what, "", "| flag | default | what it does |", "|---|---|---|"]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            out.append(f"| {_flag_cell(action)} | {_default_cell(action)} | {_help_cell(parser, action)} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/flags.md is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(OUT) as f:
            if f.read() != text:
                print(f"{OUT} is out of date: run python scripts/make_flag_reference.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
