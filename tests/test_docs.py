"""The README's two set-up commands are the ones CI runs, and the documents' links resolve.

CI (``.ci/run``) installs with the README's install command and runs the README's test command; a
README edited without ``.ci/run`` (or the reverse) fails here. Every relative link in the README,
``docs/`` and the benchmark notes must name a file that exists.
"""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_readme_setup_commands_are_what_ci_runs():
    readme, ci = _read("README.md"), _read(".ci/run")
    blocks = _bash_blocks(readme)
    install = next(b for b in blocks if "pip install -e" in b).strip()
    test = next(b for b in blocks if "pytest" in b).strip()
    extras = re.search(r'pip install -e "(\.\[[^\]]*\])"', install).group(1)
    assert f'pip install -q -e "{extras}"' in ci, (extras, "not what .ci/run installs")
    assert install.endswith("python -m sglang_k3.launch_server"), install
    assert test == "python -m pytest tests -q", test
    assert test in ci


def test_readme_stays_short():
    # The README is for users; reference material and results live in docs/.
    assert len(_read("README.md").splitlines()) <= 250


def test_relative_links_resolve():
    docs = ["README.md", *glob.glob("docs/*.md", root_dir=REPO), *glob.glob("benchmarks/*NOTES.md", root_dir=REPO)]
    assert len(docs) >= 6
    broken = []
    for rel in docs:
        base = os.path.dirname(os.path.join(REPO, rel))
        for target in LINK.findall(_read(rel)):
            if "://" in target:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(base, target))):
                broken.append(f"{rel}: {target}")
    assert not broken, broken


def test_the_full_tier_names_tests_that_exist():
    """Every entry of the full tier (tests/conftest.py) names a test module, function or case
    that exists: a renamed test would otherwise leave the entry matching nothing, and the test
    would run in the default tier unnoticed (or the entry would look like coverage it is not)."""
    from conftest import FULL_TIER

    for node in FULL_TIER:
        path, _, name = node.partition("::")
        assert os.path.isfile(os.path.join(REPO, path)), node
        func = re.sub(r"\[.*\]$", "", name)
        if func:
            assert re.search(rf"^def {re.escape(func)}\(", _read(path), re.M), node
