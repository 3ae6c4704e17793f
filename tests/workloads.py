"""Seeded random workloads in token ids (the embedded tokenizer is byte-level: ids 0-255 are bytes)."""

from __future__ import annotations

import dataclasses
import random

from benchmarks.live.differential import PRINTABLE, random_tokens  # noqa: F401  (one definition)


@dataclasses.dataclass
class Turn:
    conv: int
    prompt: list[int]
    max_new_tokens: int


def multi_turn_conversations(
    seed: int,
    n_conv: int = 2,
    n_turns: int = 4,
    system_len: int = 90,
    user_len: tuple[int, int] = (40, 150),
    reply_len: int = 12,
):
    """Yields, in interleaved order, (conv, turn, user_tokens); the caller builds prompts from replies.

    All conversations share one system prompt; each turn's prompt is the previous prompt, the
    previous reply and a new user message, so turns extend each other.
    """
    rng = random.Random(seed)
    system = random_tokens(rng, system_len)
    order = [(c, t) for t in range(n_turns) for c in range(n_conv)]
    users = {(c, t): random_tokens(rng, rng.randint(*user_len)) for c, t in order}
    return system, order, users, reply_len


def run_conversations(server, seed: int, **kw) -> list[dict]:
    """Drive interleaved multi-turn conversations against ``server``; returns per-turn records."""
    system, order, users, reply_len = multi_turn_conversations(seed, **kw)
    history = {c: list(system) for c, _ in order}
    records = []
    for c, t in order:
        prompt = history[c] + users[(c, t)]
        out = server.generate(prompt, reply_len)
        reply = out["output_ids"]
        records.append(
            {
                "conv": c,
                "turn": t,
                "prompt_len": len(prompt),
                "output_ids": reply,
                "cached_tokens": out["meta_info"].get("cached_tokens", 0),
            }
        )
        history[c] = prompt + reply
    return records
