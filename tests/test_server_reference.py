"""The served model agrees with a plain-torch forward of the same checkpoint (fp32)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from kimi_reference import KimiLinearReference
from workloads import random_tokens

SEED = 1234
LENGTHS = [5, 63, 64, 130, 200]
LOGPROB_ATOL = 2e-3
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def reference(embedded_model_dir):
    return KimiLinearReference(embedded_model_dir)


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logprobs_and_greedy_match_reference(server_factory, reference, length):
    server = server_factory("nocache")
    rng = random.Random(SEED + length)
    ids = random_tokens(rng, length)
    out = server.generate(ids, NEW_TOKENS, return_logprob=True, logprob_start_len=0)
    ref_logits = reference.logits(ids)
    ref_logprobs = torch.log_softmax(ref_logits, -1)
    served = out["meta_info"]["input_token_logprobs"]
    assert len(served) == length
    worst = 0.0
    for pos in range(1, length):
        lp, tok = served[pos][0], served[pos][1]
        assert tok == ids[pos]
        worst = max(worst, abs(lp - float(ref_logprobs[pos - 1, tok])))
    assert worst < LOGPROB_ATOL, f"max |logprob diff| {worst}"
    expected = reference.greedy(ids, NEW_TOKENS)
    assert out["output_ids"] == expected
    assert all(math.isfinite(x[0]) for x in out["meta_info"]["output_token_logprobs"])
