"""Speculative decoding with the k3 cache (issue #34): NGRAM on the CPU platform, real servers.

``k3_spec`` is the ``k3`` server (fp32 checkpoints) with ``--speculative-algorithm NGRAM`` and four
drafts a verify (one chain on CPU). Its greedy tokens must equal the cache-off server's without
speculation, token for token, while drafts are really accepted (the verify's KDA states, conv
windows, MLA KV moves and commit all run on the CPU path); the same conversations must report the
same ``cached_tokens`` as the ``k3`` server without speculation; an abort or a retraction
mid-speculation leaves no request tracked and no state slot held.

NGRAM proposes drafts from n-grams seen before (this request's and earlier ones'); a random model
rarely repeats itself, so each workload asks some prompts twice: the second time the first
answer is in the corpus and drafts are accepted.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from server_utils import abort_variants_mid_flight, k3_state, wait_untracked
from workloads import random_tokens

NEW = 40


def _spec(meta: dict) -> tuple[int, int]:
    return meta.get("spec_num_correct_drafts", 0), meta.get("spec_verify_ct", 0)


def test_greedy_tokens_equal_the_cache_off_server_with_drafts_accepted(server_factory, nocache_reference):
    """Random prompts, each asked twice (the second answer is drafted from the first), and
    prompts that extend an earlier answer: every answer equals the cache-off server's."""
    rng = random.Random(3434)
    prompts = [random_tokens(rng, rng.randint(40, 160)) for _ in range(6)]
    lens = [rng.randint(17, NEW) for _ in prompts]  # not multiples of the verify's 4 tokens
    work = [(p, n) for p, n in zip(prompts, lens) for _ in range(2)]

    def run(server):
        return [server.generate(p, n)["output_ids"] for p, n in work]

    want = nocache_reference(("spec_repeat", 3434), run)
    s = server_factory("k3_spec")
    accepted = verifies = 0
    for (p, n), ref in zip(work, want):
        out = s.generate(p, n)
        assert out["output_ids"] == ref, (len(p), n)
        a, v = _spec(out["meta_info"])
        accepted, verifies = accepted + a, verifies + v
    # the verify path ran and drafts were accepted (the repeats are drafted from their first run)
    assert verifies > 0 and accepted >= sum(lens) // 2, (accepted, verifies)


def _conversations(rng: random.Random):
    """Three chats over a shared system prompt, three turns each, and a branch of each that
    leaves at turn 2 (a different user message after the same first answer)."""
    system = random_tokens(rng, 220)
    return system, [random_tokens(rng, rng.randint(20, 60)) for _ in range(3)]


def _run_chats(server, seed: int) -> list[tuple[int, int, list[int]]]:
    rng = random.Random(seed)
    system, firsts = _conversations(rng)
    rows = []
    chats = [system + f for f in firsts]
    branches = []
    for turn in range(3):
        for c in range(len(chats)):
            out = server.generate(chats[c], 24)
            rows.append((len(chats[c]), out["meta_info"]["cached_tokens"], out["output_ids"]))
            if turn == 0:
                branches.append(chats[c] + out["output_ids"] + random_tokens(rng, 15))
            chats[c] = chats[c] + out["output_ids"] + random_tokens(rng, 15)
    for b in branches:
        out = server.generate(b, 24)
        rows.append((len(b), out["meta_info"]["cached_tokens"], out["output_ids"]))
    return rows


def test_conversations_and_branches_hit_as_without_speculation(server_factory):
    """The same chats and branches on ``k3`` and on ``k3_spec``: equal answers and equal
    ``cached_tokens`` for every request: a verify keeps the states the cache places (a turn's
    end holds the state after its accepted tokens only)."""
    seed = 3435
    plain = _run_chats(server_factory("k3"), seed)
    spec = _run_chats(server_factory("k3_spec"), seed)
    assert [r[2] for r in spec] == [r[2] for r in plain]
    assert [r[1] for r in spec] == [r[1] for r in plain]
    # later turns restore the previous prompt and answer (to one token), branches their stem
    assert all(cached >= 220 for _, cached, _ in spec[3:]), [r[1] for r in spec]


def check_fork_program_hits(server, seed: int) -> None:
    """A frontend ``fork`` program (tests/test_frontend_fork.py's) run twice over one context:
    both runs succeed, and the second run's branches restore the shared context."""
    import sglang as sgl
    from test_frontend_fork import PREFIX_LEN, branches
    from workloads import PRINTABLE

    rng = random.Random(seed)
    prefix = "".join(chr(rng.choice(PRINTABLE)) for _ in range(PREFIX_LEN))
    backend = sgl.RuntimeEndpoint(server.url)
    first = branches.run(prefix=prefix, num_branches=3, label="Branch", backend=backend)
    assert first.error() is None
    second = branches.run(prefix=prefix, num_branches=3, label="Option", backend=backend)
    assert second.error() is None
    for m in second.ret_value:
        assert m["completion_tokens"] == 6
        assert m["cached_tokens"] >= 128, m  # the shared context, up to a chunk boundary


def test_a_frontend_fork_program_hits_under_speculation(server_factory):
    check_fork_program_hits(server_factory("k3_spec"), 3436)


def test_an_abort_mid_speculation_leaves_no_state_behind(server_factory):
    """Four long requests decoding speculatively (drafted from an earlier run of the same
    prompt), aborted mid-flight: no request is tracked, no state slot is held, and the server
    still answers the prompt with the cache-off server's tokens."""
    s = server_factory("k3_spec")
    rng = random.Random(3437)
    prompt = random_tokens(rng, 120)
    first = s.generate(prompt, 300)
    abort_variants_mid_flight(s, prompt, 300)
    assert k3_state(s)["memory_active_bytes"] == 0
    again = s.generate(prompt, 300)
    assert again["output_ids"] == first["output_ids"]


def check_retracted_rounds(server, nocache_reference, seed: int, new_tokens: int, min_cached: int) -> list[dict]:
    """Four random prompts decoded at once, twice, on ``server`` (one whose SGLang retraction hook
    fires mid-flight): every answer equals the cache-off server's, the second round's prompts
    restore at least ``min_cached`` tokens, the hook fired, and afterwards nothing is tracked or
    held. Returns the second round's outputs."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, rng.randint(60, 140)) for _ in range(4)]

    def run(srv):
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda p: srv.generate(p, new_tokens), prompts))

    want = nocache_reference(("retracted_rounds", seed, new_tokens), lambda srv: [o["output_ids"] for o in run(srv)])
    for round_ in range(2):  # the second round restores (and, for NGRAM, is drafted from) the first
        outs = run(server)
        assert [o["output_ids"] for o in outs] == want, round_
    assert all(o["meta_info"]["cached_tokens"] >= min_cached for o in outs), [
        o["meta_info"]["cached_tokens"] for o in outs
    ]
    with open(server.log_path, errors="replace") as f:
        retractions = f.read().count("Testing retraction")
    assert retractions >= 4, retractions  # the hook really fired, mid-speculation
    state = wait_untracked(server)
    assert state["tracked_requests"] == 0 and state["memory_active_bytes"] == 0, state
    return outs


def test_retractions_mid_speculation_keep_greedy_tokens_and_leave_no_state(server_factory, nocache_reference):
    """Four requests decoding speculatively at once, retracted again and again mid-flight by
    SGLang's own hook (``k3_spec_retract``: every third forward). A retracted request goes back to
    the queue, gives up its state slot and KV, and is prefilled again from what the cache holds:
    every answer equals the cache-off server's, drafts are still accepted the second time round, the
    prompts still hit, and nothing stays tracked or held."""
    outs = check_retracted_rounds(server_factory("k3_spec_retract"), nocache_reference, 3438, 48, 64)
    accepted = sum(_spec(o["meta_info"])[0] for o in outs)
    assert accepted >= 48, accepted  # of 4 x 48 tokens


def test_a_turn_that_stops_inside_a_verify_is_cached_as_without_speculation(server_factory):
    """A verify commits a run of accepted tokens; when the request stops inside it (here at
    ``max_new_tokens``) SGLang keys the turn only up to the stop and would insert nothing, so the
    next turn would recompute the answer. The k3 cache sets the state back to the stop from the
    verify's scratch (``speculative_stops_rewound``) and the turn is cached as on ``k3``.

    Prompt P is answered first with 60 tokens (its answer enters the n-gram corpus and the tree),
    then again with 31: the second run is drafted from the first and stops inside a run of
    accepted tokens. The next turn continues the 31-token answer; only the second run's turn end
    holds a state there (the first run's is 29 tokens further on). Without the rewind it restores
    the prompt's state only (100 tokens, measured)."""
    rng = random.Random(3438)
    prompt = random_tokens(rng, 100)
    user = random_tokens(rng, 12)

    def run(server):
        server.generate(prompt, 60)
        second = server.generate(prompt, 31)
        nxt = prompt + second["output_ids"] + user
        return second, server.generate(nxt, 8)

    plain_second, plain_next = run(server_factory("k3"))
    s = server_factory("k3_spec")
    before = k3_state(s)
    second, nxt = run(s)
    after = k3_state(s)
    assert second["output_ids"] == plain_second["output_ids"] and nxt["output_ids"] == plain_next["output_ids"]
    assert second["meta_info"]["spec_num_correct_drafts"] > 0
    assert after["speculative_stops_rewound"] > before["speculative_stops_rewound"], after
    # k3 without speculation keeps the turn's end at 130 (the last answer token's KV is computed
    # by the next forward); the verify computed it already (an accepted draft), so the stop is at
    # 131 and the next turn restores one token more
    assert nxt["meta_info"]["cached_tokens"] >= plain_next["meta_info"]["cached_tokens"] >= 100 + 31 - 1
