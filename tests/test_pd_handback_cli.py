"""``python -m benchmarks.pd_handback``: its help and clear errors for bad flags. The deployments it
compares are exercised end to end by tests/test_pd_fleet.py (a real PD fleet with the hand-back),
so this test does not start them again."""

from __future__ import annotations

from server_utils import check_cli


def test_help_names_the_three_deployments_and_bad_flags_fail_with_the_reason():
    check_cli(
        "benchmarks.pd_handback",
        ("single", "pd_handback", "--server-args", "--conversations", "Mooncake"),
        ((["--only", "pd,nope"], "--only"), (["--turns", "0"], "--turns"), (["--reply-len", "0"], "--reply-len")),
    )
