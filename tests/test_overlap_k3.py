"""The k3 cache under SGLang's overlap scheduler (launch_server's default for k3).

Under overlap, step N+1 is launched before step N's results are processed. A request whose
prefill ended at step N is already in the decode step N+1 when the cache checkpoints its prompt
end, so its live state slot holds one token more than the boundary. The cache must never store
that state under the prompt end (``CacheLifecycle.checkpoint_running``'s ``state_len`` guard); it
keeps the state the prefill itself exported at the last 64-token boundary instead.
"""

from __future__ import annotations

import json
import random

import requests
from server_utils import k3_state
from workloads import random_tokens


def _overlap_on(s) -> bool:
    r = requests.get(s.url + "/server_info", timeout=60)
    r.raise_for_status()
    return r.json()["disable_overlap_schedule"] is False


def _while_decoding(s, first: list[int], first_new: int, second: list[int], second_new: int) -> tuple[dict, dict]:
    """Send ``first`` (streamed); once its first token arrived (its prefill is processed and it
    decodes), send ``second`` and wait for it; then drain ``first``."""
    body = {
        "input_ids": first,
        "stream": True,
        "sampling_params": {"max_new_tokens": first_new, "temperature": 0.0, "ignore_eos": True},
    }
    with requests.post(s.url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        last = None
        for line in lines:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
                if last.get("output_ids"):
                    break
        during = s.generate(second, second_new)
        for line in lines:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
    assert last is not None and last["meta_info"]["finish_reason"]["type"] == "length"
    return last, during


def test_a_prompt_continued_while_its_first_request_decodes_restores_a_true_state(server_factory):
    k3, plain = server_factory("k3"), server_factory("nocache")
    assert _overlap_on(k3), "launch_server should leave the overlap scheduler on for k3"
    k3.flush_cache()
    before = k3_state(k3)["stale_state_skips"]
    rng = random.Random(71)
    for _ in range(3):
        prompt = random_tokens(rng, rng.randint(140, 250))
        other = prompt + random_tokens(rng, rng.randint(10, 40))
        _, hit = _while_decoding(k3, prompt, 48, other, 8)
        want = plain.generate(other, 8)
        assert hit["output_ids"] == want["output_ids"]
        cached = hit["meta_info"]["cached_tokens"]
        # the prefill's own export at the last 64-token boundary before the prompt end
        assert cached == (len(prompt) - 1) // 64 * 64, (cached, len(prompt))
    # the overlap path was taken: each prompt-end copy found its slot a step ahead and was skipped
    assert k3_state(k3)["stale_state_skips"] - before >= 3
