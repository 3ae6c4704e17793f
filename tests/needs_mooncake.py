"""``needs_mooncake()``: the Mooncake tests' one gate on the Mooncake wheel and its system libraries.

The wheel is in the ``test`` extra, so a test run after the README's setup has it. A missing system
library (libibverbs1) is the machine's fault, not the code's: outside CI the test is skipped with
the command that installs it; in CI (``CI`` set, as ``.ci/run`` runs) it fails, so a CI machine
without the library cannot pass by skipping every Mooncake test in silence.
"""

from __future__ import annotations

import os

import pytest

from sglang_k3.tiers.system_deps import MissingDependency, store_client_class


def needs_mooncake() -> None:
    try:
        store_client_class("the Mooncake tests")
    except MissingDependency as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes") and "wheel" not in e.missing:
            pytest.fail(str(e), pytrace=False)
        pytest.skip(str(e), allow_module_level=True)
