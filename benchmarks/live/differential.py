"""Randomized, seeded request scripts for differential runs (cache on vs. cache off).

Shared by the tests (``tests/test_differential_k3.py``) and the soak (``benchmarks/soak.py``).

A script is a list of rounds; the requests of one round are sent concurrently, so the server
batches and interleaves them. Prompts are built from earlier outputs where a workload continues a
conversation, so the same script replays identically against any server whose greedy tokens match.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

PRINTABLE = list(range(32, 127))


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(PRINTABLE) for _ in range(n)]


def make_script(seed: int, n_rounds: int = 4) -> dict:
    """A mix of multi-turn conversations, shared system prompts, fork branches, repeated
    prompts and prompts ending mid-chunk (lengths not multiples of 64)."""
    rng = random.Random(seed)
    system = random_tokens(rng, rng.randint(70, 140))
    convs = [{"prefix": system + random_tokens(rng, rng.randint(5, 90))} for _ in range(2)]
    fork_base = random_tokens(rng, rng.randint(64, 200))
    rounds = []
    for r in range(n_rounds):
        reqs = []
        for c in range(len(convs)):
            reqs.append({"kind": "turn", "conv": c, "user": random_tokens(rng, rng.randint(10, 80))})
        n_branches = rng.randint(1, 3)
        for _ in range(n_branches):
            reqs.append({"kind": "fork", "suffix": random_tokens(rng, rng.randint(1, 40))})
        if r > 0 and rng.random() < 0.7:
            reqs.append({"kind": "repeat"})
        rng.shuffle(reqs)
        rounds.append(reqs)
    return {"seed": seed, "convs": convs, "fork_base": fork_base, "rounds": rounds, "reply_len": rng.randint(4, 10)}


def run_script(server, script: dict, logprobs: bool = False) -> list[dict]:
    history = [list(c["prefix"]) for c in script["convs"]]
    last_prompt: list[int] | None = None
    records = []
    for r, reqs in enumerate(script["rounds"]):
        prompts = []
        for q in reqs:
            if q["kind"] == "turn":
                prompts.append(history[q["conv"]] + q["user"])
            elif q["kind"] == "fork":
                prompts.append(script["fork_base"] + q["suffix"])
            else:
                prompts.append(list(last_prompt or script["fork_base"]))
        with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
            extra = {"return_logprob": True} if logprobs else {}
            outs = list(ex.map(lambda p, extra=extra: server.generate(p, script["reply_len"], **extra), prompts))
        for q, p, o in zip(reqs, prompts, outs):
            rec = {
                "round": r,
                "kind": q["kind"],
                "prompt_len": len(p),
                "output_ids": o["output_ids"],
                "cached_tokens": o["meta_info"].get("cached_tokens", 0),
            }
            if logprobs:
                rec["output_logprobs"] = [t[0] for t in o["meta_info"]["output_token_logprobs"]]
            records.append(rec)
            if q["kind"] == "turn":
                history[q["conv"]] = p + o["output_ids"]
        last_prompt = prompts[0]
    return records


def compare(a: list[dict], b: list[dict]) -> list[str]:
    """Mismatches between two runs of one script, as readable lines (empty when equal)."""
    bad = []
    for x, y in zip(a, b):
        if x["output_ids"] != y["output_ids"]:
            bad.append(f"round {x['round']} {x['kind']} len {x['prompt_len']}: {x['output_ids']} != {y['output_ids']}")
    if len(a) != len(b):
        bad.append(f"record counts differ: {len(a)} != {len(b)}")
    return bad
