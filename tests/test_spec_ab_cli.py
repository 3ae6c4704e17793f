"""``python -m benchmarks.spec_ab``: its help and clear errors for bad flags, and the accept length
it reports. The servers it compares are exercised end to end by tests/test_speculative.py (k3 with
NGRAM against k3 and a cache-off server), so this test does not start them again."""

from __future__ import annotations

from server_utils import check_cli


def test_help_names_the_four_servers_and_bad_flags_fail_with_the_reason():
    check_cli(
        "benchmarks.spec_ab",
        ("k3_spec", "upstream_spec", "off_spec", "--spec-args", "--repeat-prompts", "accept length"),
        (
            (["--only", "k3,nope"], "--only"),
            (["--repeat-prompts", "0"], "--repeat-prompts"),
            (["--turns", "0"], "--turns"),
        ),
    )


def test_accept_length_is_tokens_committed_per_verify():
    """Per verify the target commits its own token plus the drafts it accepted; requests that
    failed do not count, and without speculation there is no accept length."""
    from benchmarks.live.client import Result, summarize_results

    ok = [
        Result("a", prompt_tokens=10, output_ids=[1] * 9, spec_correct_drafts=4, spec_verifies=4),
        Result("b", prompt_tokens=10, output_ids=[1] * 5, spec_correct_drafts=0, spec_verifies=4),
        Result("c", spec_correct_drafts=7, spec_verifies=1, error="HTTP 500"),
    ]
    m = summarize_results(ok, 1.0)
    assert m["spec_verifies"] == 8 and m["accept_length"] == (8 + 4) / 8
    assert summarize_results([Result("d", prompt_tokens=3, output_ids=[1])], 1.0)["accept_length"] is None


def test_the_report_names_the_algorithm_of_the_spec_args():
    from benchmarks.spec_ab import DEFAULT_SPEC, algorithm

    assert algorithm(DEFAULT_SPEC) == "NGRAM"
    assert algorithm("--speculative-algorithm=EAGLE3 --speculative-draft-model-path /d") == "EAGLE3"
    assert algorithm("--speculative-num-steps 3 --speculative-algorithm EAGLE") == "EAGLE"
    assert algorithm("--speculative-num-steps 3") == "?"
