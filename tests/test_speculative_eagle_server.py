"""EAGLE and EAGLE3 speculative decoding with the k3 cache on the CPU platform, real servers
(issue #34).

The drafts are built for the embedded model here: an EAGLE3 draft with random weights, and an
EAGLE draft fitted to the target's own greedy answers (``tiny_draft.fit_followers``: after token
``x`` it proposes the token the cache-off server's answers most often put after ``x``), so that
its drafts are really accepted (about one in ten on fresh prompts) and the verify's accept path
runs: the KDA states committed after accepted drafts, the draft's extend over them, the KV moves.
A random draft is all but never accepted. The EAGLE server drafts chains of three
(``--speculative-num-steps 3``: a torch-native draft backend per step), the EAGLE3 server
``launch_server``'s CPU default of one (``--speculative-num-steps 1 --speculative-eagle-topk 1
--speculative-num-draft-tokens 2``); fp32 checkpoints, SGLang's fixed pools.

Each test holds the cache to what it gives without speculation: greedy tokens equal the
cache-off server's, and the same conversations report the same ``cached_tokens`` as ``k3``
without speculation over the same pools and scheduling; an abort mid-speculation leaves nothing
tracked and no slot held.
"""

from __future__ import annotations

import collections
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import SERVER_CONFIGS, SERVER_ENVS
from server_utils import abort_variants_mid_flight
from test_speculative import _run_chats, _spec, check_fork_program_hits, check_retracted_rounds
from workloads import random_tokens

FOLLOWER_PROMPTS, FOLLOWER_NEW = 32, 64
_PLAIN: dict[str, list] = {}  # the chats on the server without speculation, run once


def _assert_no_idle_leak(server) -> None:
    """Idle a moment, so SGLang checks its KV, request and state pools (strict by default: a leak
    is logged as "memory leak detected" and stops the server), then read its log for one."""
    time.sleep(2)
    with open(server.log_path, errors="replace") as f:
        assert "memory leak detected" not in f.read()


def _followers(server, seed: int) -> dict[int, int]:
    """For each token the cache-off server's greedy answers contain, the token they most often
    put after it."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, rng.randint(20, 80)) for _ in range(FOLLOWER_PROMPTS)]
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda p: server.generate(p, FOLLOWER_NEW)["output_ids"], prompts))
    pairs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for p, a in zip(prompts, answers):
        seq = p[-1:] + a
        for x, y in zip(seq, seq[1:]):
            pairs[x][y] += 1
    return {x: c.most_common(1)[0][0] for x, c in pairs.items()}


@pytest.fixture(scope="module")
def eagle_servers(server_factory, tmp_path_factory):
    """Registers ``k3_eagle`` (the fitted EAGLE draft), ``k3_eagle3`` (a random EAGLE3 draft) and
    ``k3_fixed_sync`` (``k3`` over the pools and scheduling the speculative servers get) with
    the session's server configurations."""
    from sglang_k3.model.tiny_build import default_model_path
    from sglang_k3.model.tiny_draft import build_draft, fit_followers

    target = default_model_path()
    root = tmp_path_factory.mktemp("drafts")
    eagle = build_draft(target, str(root / "eagle"), "eagle", seed=34)
    ranked = fit_followers(eagle, target, _followers(server_factory("nocache"), 3440))
    assert ranked > 0.9, ranked  # the fit ranks nearly every follower first
    eagle3 = build_draft(target, str(root / "eagle3"), "eagle3", seed=35)
    SERVER_CONFIGS["k3_fixed_sync"] = [
        "--k3-checkpoint-dtype",
        "fp32",
        "--k3-no-unified-memory",
        "--disable-overlap-schedule",
    ]
    # EAGLE drafts chains of three (a torch-native draft backend per step), EAGLE3 launch_server's
    # CPU default of one
    chains = (("k3_eagle", "EAGLE", eagle, ["--speculative-num-steps", "3"]), ("k3_eagle3", "EAGLE3", eagle3, []))
    spec = {
        name: ["--speculative-algorithm", algo, "--speculative-draft-model-path", path, *steps]
        for name, algo, path, steps in chains
    }
    for name, flags in spec.items():
        SERVER_CONFIGS[name] = ["--k3-checkpoint-dtype", "fp32", *flags]
    # the cache-off server with the same EAGLE draft: the acceptance the k3 server's must match
    SERVER_CONFIGS["off_eagle"] = ["--disable-radix-cache", *spec["k3_eagle"]]
    # EAGLE with SGLang's retraction test hook (every third forward retracts running decodes), as
    # k3_spec_retract is for NGRAM
    SERVER_CONFIGS["k3_eagle_retract"] = SERVER_CONFIGS["k3_eagle"]
    SERVER_ENVS["k3_eagle_retract"] = SERVER_ENVS["k3_spec_retract"]
    yield
    for name in ("k3_eagle", "k3_eagle3", "k3_fixed_sync", "k3_eagle_retract", "off_eagle"):
        SERVER_CONFIGS.pop(name, None)
    SERVER_ENVS.pop("k3_eagle_retract", None)


def test_greedy_tokens_equal_the_cache_off_server_with_eagle_drafts_accepted(
    eagle_servers, server_factory, nocache_reference
):
    """Random prompts, each asked twice (the second restores the first's states), and prompts
    that extend an earlier answer: every answer of the EAGLE server equals the cache-off
    server's, token for token, while its drafts are accepted, and as often as the cache-off
    server's with the same draft accepts them (acceptance unchanged by the cache)."""
    rng = random.Random(3441)
    prompts = [random_tokens(rng, rng.randint(40, 160)) for _ in range(6)]
    lens = [rng.randint(17, 40) for _ in prompts]
    work = [(p, n) for p, n in zip(prompts, lens) for _ in range(2)]

    def run(server):
        return [server.generate(p, n)["output_ids"] for p, n in work]

    want = nocache_reference(("eagle_repeat", 3441), run)
    off = server_factory("off_eagle")
    off_spec = [_spec(off.generate(p, n)["meta_info"]) for p, n in work]
    s = server_factory("k3_eagle")
    accepted = verifies = hits = 0
    per_request = []
    for (p, n), ref in zip(work, want):
        out = s.generate(p, n)
        assert out["output_ids"] == ref, (len(p), n)
        a, v = _spec(out["meta_info"])
        per_request.append((a, v))
        accepted, verifies, hits = accepted + a, verifies + v, hits + out["meta_info"]["cached_tokens"]
    assert verifies >= sum(lens) - len(lens) and accepted >= verifies // 30, (accepted, verifies)
    # The same answers drafted by the same draft: the same drafts accepted, request by request,
    # the repeats (restored from the cache) included. A draft reads the target's hidden states,
    # which a restore changes only by fp32 rounding (a shorter extend), so a near-tie could flip
    # one draft: at most one request may differ, by one draft.
    differ = [(i, k3, o) for i, (k3, o) in enumerate(zip(per_request, off_spec)) if k3 != o]
    assert len(differ) <= 1 and all(abs(k3[0] - o[0]) <= 1 for _, k3, o in differ), differ
    # each repeat restored its prompt's last state on the 64-token grid
    assert hits >= sum((len(p) - 1) // 64 * 64 for p in prompts), hits
    # continuations of each prompt's answer restore past the prompt, and still equal cache off
    rng2 = random.Random(3442)
    more = [p + ref + random_tokens(rng2, 9) for (p, _), ref in zip(work[::2], want[::2])]
    want_more = nocache_reference(
        ("eagle_continue", 3442), lambda srv: [srv.generate(m, 20)["output_ids"] for m in more]
    )
    for m, ref, (p, _) in zip(more, want_more, work[::2]):
        out = s.generate(m, 20)
        assert out["output_ids"] == ref
        assert out["meta_info"]["cached_tokens"] >= len(p), (out["meta_info"]["cached_tokens"], len(p))


@pytest.mark.parametrize("name", ["k3_eagle", "k3_eagle3"])
def test_conversations_and_branches_hit_as_without_speculation(eagle_servers, server_factory, name):
    """The same chats and branches with EAGLE / EAGLE3 and on ``k3`` without speculation over the
    same pools and scheduling (``k3_fixed_sync``: with a draft model the k3 cache runs over
    SGLang's fixed pools, and SGLang runs speculation without the overlap scheduler): equal
    answers, and every request restores what it restores without speculation (a turn's end holds
    the state after its accepted tokens only; the draft's own KV is not the tree's business), or
    one token more where the turn's last token was an accepted draft, whose KV the verify already
    computed (as with NGRAM: test_speculative.py, the stop inside a verify).

    Measured on this workload: over the unified budget with the overlap scheduler (``k3``) the
    branches restore their stem's generation end (295, 296, 280 tokens); over fixed pools
    without overlap, with or without speculation, their stem's prompt end (272, 273, 257), and
    over fixed pools with overlap the 64-token grid (256): the unified budget keeps the states
    the rules let go while memory is free."""
    seed = 3443
    if "k3_fixed_sync" not in _PLAIN:  # once: a second run would find the first's states
        _PLAIN["k3_fixed_sync"] = _run_chats(server_factory("k3_fixed_sync"), seed)
    plain = _PLAIN["k3_fixed_sync"]
    spec = _run_chats(server_factory(name), seed)
    assert [r[2] for r in spec] == [r[2] for r in plain]
    pairs = [(r[1], q[1]) for r, q in zip(spec, plain)]
    assert all(p <= s <= p + 1 for s, p in pairs), pairs
    assert all(cached >= 220 for _, cached, _ in spec[3:]), [r[1] for r in spec]


def test_an_abort_mid_eagle_speculation_leaves_no_state_behind(eagle_servers, server_factory):
    """Four long requests decoding with EAGLE drafts, aborted mid-flight: no request is tracked,
    no state slot or KV is left allocated (SGLang's own idle check of its pools, strict by
    default: a leak stops the server and is logged as "memory leak detected"), and the server
    still answers the prompt as before."""
    s = server_factory("k3_eagle")
    rng = random.Random(3444)
    prompt = random_tokens(rng, 120)
    first = s.generate(prompt, 200)
    abort_variants_mid_flight(s, prompt, 200)
    _assert_no_idle_leak(s)
    assert s.generate(prompt, 200)["output_ids"] == first["output_ids"]


def test_a_frontend_fork_program_hits_under_eagle_speculation(eagle_servers, server_factory):
    """The frontend ``fork`` program of the NGRAM test, on the EAGLE server: its branches restore
    the shared context."""
    check_fork_program_hits(server_factory("k3_eagle"), 3445)


def test_retractions_mid_eagle_speculation_keep_greedy_tokens_and_leave_no_state(
    eagle_servers, server_factory, nocache_reference
):
    """Four requests decoding with EAGLE drafts at once, retracted again and again mid-flight by
    SGLang's own hook (every third forward). A retracted request gives up its state slot, its KV
    and its draft's KV, and is prefilled again (target and draft) from what the cache holds:
    every answer equals the cache-off server's, the prompts still hit, and nothing stays
    tracked or held (SGLang's strict idle check of its pools logs a leak otherwise)."""
    s = server_factory("k3_eagle_retract")
    check_retracted_rounds(s, nocache_reference, 3446, 40, 60)
    _assert_no_idle_leak(s)
