"""docs/flags.md is what ``scripts/make_flag_reference.py`` renders from the parsers the commands
run with: a flag added, removed or re-documented without regenerating it fails here."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_flag_reference", os.path.join(REPO, "scripts", "make_flag_reference.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flag_reference_is_current():
    gen = _generator()
    with open(gen.OUT) as f:
        on_disk = f.read()
    assert on_disk == gen.render(), "docs/flags.md is out of date: run python scripts/make_flag_reference.py"


def test_every_k3_flag_is_documented():
    # The rendered reference lists every --k3- flag launch_server parses, with its default.
    gen = _generator()
    text = gen.render()
    parser = gen._k3_parser()
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--k3-")]
    assert len(flags) >= 20
    for flag in flags:
        assert f"| `{flag}" in text, flag
