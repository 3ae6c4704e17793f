"""INT8 checkpoints (the default) against fp32 checkpoints: greedy agreement and logit drift.

The same randomized scripts run on a server with int8 checkpoints and one with fp32 checkpoints.
Restores from int8 continue in full precision, so drift stays small; the numbers are reported
(``-s`` shows them) and bounded.
"""

from __future__ import annotations

import math

import pytest
from scripted_workload import make_script, run_script

SEEDS = [303, 404]


@pytest.mark.parametrize("int8_config, fp32_config", [("k3_int8", "k3"), ("k3_page64_int8", "k3_page64")])
def test_int8_restores_agree_with_fp32(server_factory, int8_config, fp32_config):
    int8, fp32 = server_factory(int8_config), server_factory(fp32_config)
    agree = total = 0
    drift = 0.0
    hits = 0
    for seed in SEEDS:
        script = make_script(seed)
        a = run_script(int8, script, logprobs=True)
        b = run_script(fp32, script, logprobs=True)
        for x, y in zip(a, b):
            hits += x["cached_tokens"] > 0
            n = 0
            for ta, tb in zip(x["output_ids"], y["output_ids"]):
                if ta != tb:
                    break
                n += 1
            agree += n
            total += len(y["output_ids"])
            # logprob of the same chosen tokens, over the agreeing prefix
            for la, lb in zip(x["output_logprobs"][:n], y["output_logprobs"][:n]):
                drift = max(drift, abs(la - lb))
    rate = agree / total
    print(
        f"\n{int8_config} vs {fp32_config}: greedy agreement {rate:.4f} ({agree}/{total} tokens), "
        f"max |logprob drift| {drift:.2e}, {hits} requests restored from a checkpoint"
    )
    assert hits > 0
    assert math.isfinite(drift) and drift < 0.05
    assert rate > 0.9
