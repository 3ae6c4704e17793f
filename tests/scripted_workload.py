"""The differential scripts live in ``benchmarks/live/differential.py`` (shared with the soak)."""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.live.differential import compare, make_script, run_script  # noqa: E402,F401
