"""Trace families for the retention suite (``python -m benchmarks.suite``), Mooncake JSONL format.

    python -m benchmarks.suite_traces docs --out /tmp/docs.jsonl [--requests 4000 --seed 1 ...]
    python -m benchmarks.suite_traces chat --out /tmp/chat.jsonl
    python -m benchmarks.suite_traces stats /tmp/docs.jsonl   # the sharing statistics of any trace

The rows have exactly the fields of ``../shared/data/mooncake_conversation_trace.jsonl`` and are
read through ``benchmarks/trace/mooncake.py`` (equal hash ids are equal tokens; a request that
starts with all full blocks of an earlier one and then has new ids is its next turn). The two
families here add shapes that neither the conversation trace nor ``benchmarks/fork_trace.py``
has:

``docs`` -- long prompts over shared documents (RAG, document QA). Each request belongs to one of
  ``--docs-apps`` applications (popularity 1/rank) or, with ``--docs-private``, to none (a fresh
  prompt that shares nothing). An application has a system prompt and a *document trie*: a
  request walks it from the root, at each level taking an existing child document (popularity
  1/rank among the children) or, with ``--docs-new-prob``, a new one, for a geometric number of
  documents (mean ``--docs-depth``), then adds its own question. Two requests that took the same
  first ``k`` documents share exactly those blocks and then differ: the fork lies on a block
  boundary *strictly inside* the earlier prompt, not at its end. With ``--docs-followup-prob`` a
  request gets a follow-up turn (its full blocks, then the tail + answer + a new question), which
  shares the whole earlier prompt instead. Document lengths are log-normal (median
  ``--docs-doc-median``, whole blocks), so prompts run from a few thousand tokens to over 100k.
  The defaults are set to match the statistics of a production trace held out from the project
  (issue #31): about 15,300 prompt tokens per request on average, 45% of requests sharing a prefix
  with an earlier one, and 38% of the shared blocks strictly inside an earlier prompt (the
  conversation trace: 16%); ``stats`` measures them.
``chat`` -- multi-turn chats with branches over a few long system prompts: ``--chat-systems``
  system prompts (popularity 1/rank) of ``--chat-system-*`` tokens; a conversation runs
  ``--chat-turns`` turns of short messages (``--chat-msg-*``); at a random turn, with
  ``--chat-branch-prob``, it splits into two branches (the same earlier turn, two different next
  messages: the branches fork at that turn's generation end, usually inside a 512-token block),
  each of which runs to the end. Conversations overlap (Poisson starts), so many compete for the
  cache at once. This is the shape of the live A/B's branching workload (issue #31), at trace
  scale.

Every request owns at least one full block beyond what it copies (so mooncake.py's turn rule
links exactly the designed parent) and is at least 1024 tokens. All randomness comes from
``--seed``: the same seed and flags give a byte-identical file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Iterable, Optional

BLOCK = 512
MIN_REQUEST = 2 * BLOCK


def _blocks(L: int) -> int:
    return -(-L // BLOCK)


class _Ids:
    def __init__(self):
        self.next = 0

    def new(self, n: int) -> list:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


class _Req:
    __slots__ = ("ids", "L", "O", "t", "seq")

    def __init__(self, ids: list, L: int, O: int, t: float):
        self.ids, self.L, self.O, self.t = ids, L, O, t
        self.seq = 0

    @property
    def full(self) -> int:
        return self.L // BLOCK


def _loguni(rng: random.Random, lo: int, hi: int) -> int:
    if lo >= hi:
        return lo
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _zipf(rng: random.Random, n: int) -> int:
    """An index in ``range(n)`` with popularity 1/(rank + 1)."""
    return rng.choices(range(n), weights=[1.0 / (i + 1) for i in range(n)])[0]


def _make(ids: _Ids, kept: list, carry: int, m: int, O: int, t: float, cap: int) -> Optional[_Req]:
    """A request that copies ``kept`` hash ids (``carry`` tokens before its own part, of which the
    kept ids are the whole blocks) and adds ``m`` new tokens, lengthened to own a full block;
    None when that exceeds ``cap``."""
    L = max(carry + m, len(kept) * BLOCK + BLOCK, MIN_REQUEST)
    if cap < L:
        return None
    return _Req(list(kept) + ids.new(_blocks(L) - len(kept)), L, O, t)


def _finish(a, r: _Req) -> float:
    return r.t + r.L / a.prefill_tokens_per_s + r.O * a.decode_ms_per_token / 1e3


def _rows(a, sessions: list[list[_Req]], rng: random.Random) -> list[dict]:
    """Sessions start as a Poisson process at the rate that gives ``--rate`` requests/s; hash ids
    renumbered in order of first appearance, as in the Mooncake trace."""
    n = sum(len(s) for s in sessions)
    rate_s = a.rate * len(sessions) / max(1, n)
    rows, start, seq = [], 0.0, 0
    for i, reqs in enumerate(sessions):
        if i:
            start += rng.expovariate(rate_s)
        for r in reqs:
            r.seq = seq
            seq += 1
            rows.append((int(round((start + r.t) * 1000)), r.seq, r))
    rows.sort(key=lambda x: (x[0], x[1]))
    renum: dict = {}
    out = []
    for ts, _, r in rows:
        out.append(
            {
                "timestamp": ts,
                "input_length": r.L,
                "output_length": r.O,
                "hash_ids": [renum.setdefault(h, len(renum)) for h in r.ids],
            }
        )
    return out


# ------------------------------------------------------------------ docs
class _Doc:
    __slots__ = ("ids", "children")

    def __init__(self, ids: list):
        self.ids, self.children = ids, []


def generate_docs(a) -> list[dict]:
    rng, ids = random.Random(a.seed), _Ids()
    apps = []
    for _ in range(a.docs_apps):
        apps.append(_Doc(ids.new(rng.randint(a.docs_system_min, a.docs_system_max) // BLOCK or 1)))
    sigma = a.docs_doc_sigma

    def doc_blocks() -> int:
        tokens = a.docs_doc_median * math.exp(rng.gauss(0.0, sigma))
        return max(1, min(a.max_prompt // BLOCK // 2, int(round(tokens / BLOCK))))

    sessions, n = [], 0
    while n < a.requests:
        q = _loguni(rng, a.docs_question_min, a.docs_question_max)
        O = rng.randint(a.output_min, a.output_max)
        if rng.random() < a.docs_private:
            # a prompt that shares nothing (log-normal length)
            own = int(a.docs_private_median * math.exp(rng.gauss(0.0, sigma)))
            r = _make(ids, [], 0, min(own + q, a.max_prompt), O, 0.0, a.max_prompt)
        else:
            node = apps[_zipf(rng, len(apps))]
            kept = list(node.ids)
            for _ in range(max(1, int(rng.expovariate(1.0 / a.docs_depth)) + 1)):
                if not node.children or rng.random() < a.docs_new_prob:
                    node.children.append(_Doc(ids.new(doc_blocks())))
                    child = node.children[-1]
                else:
                    child = node.children[_zipf(rng, len(node.children))]
                if (len(kept) + len(child.ids)) * BLOCK + q > a.max_prompt:
                    break
                kept += child.ids
                node = child
            r = _make(ids, kept, len(kept) * BLOCK, q, O, 0.0, a.max_prompt)
        if r is None:
            continue
        sess = [r]
        while rng.random() < a.docs_followup_prob and len(sess) < a.docs_max_turns:
            p = sess[-1]
            t = _finish(a, p) + rng.expovariate(1.0 / a.think_s)
            nxt = _make(
                ids,
                p.ids[: p.full],
                p.L + p.O,
                _loguni(rng, a.docs_question_min, a.docs_question_max),
                rng.randint(a.output_min, a.output_max),
                t,
                a.max_prompt,
            )
            if nxt is None:
                break
            sess.append(nxt)
        sess = sess[: a.requests - n]
        n += len(sess)
        sessions.append(sess)
    return _rows(a, sessions, rng)


# ------------------------------------------------------------------ chat
def generate_chat(a) -> list[dict]:
    rng, ids = random.Random(a.seed), _Ids()
    systems = [
        ids.new(max(1, rng.randint(a.chat_system_min, a.chat_system_max) // BLOCK)) for _ in range(a.chat_systems)
    ]
    sessions, n = [], 0

    def turn(p: Optional[_Req], system: list, t: float) -> Optional[_Req]:
        m = _loguni(rng, a.chat_msg_min, a.chat_msg_max)
        O = rng.randint(a.output_min, a.output_max)
        if p is None:
            return _make(ids, system, len(system) * BLOCK, m, O, t, a.max_prompt)
        return _make(ids, p.ids[: p.full], p.L + p.O, m, O, t, a.max_prompt)

    while n < a.requests:
        system = systems[_zipf(rng, len(systems))]
        turns = rng.randint(2, a.chat_turns)
        branch_at = rng.randint(1, turns - 1) if rng.random() < a.chat_branch_prob else -1
        sess: list[_Req] = []
        heads: list[Optional[_Req]] = [None]
        t = 0.0
        for k in range(turns):
            if k == branch_at:
                heads = heads + heads  # two branches continue from the same turn
            nxt = []
            for h in heads:
                start = t if h is None else _finish(a, h) + rng.expovariate(1.0 / a.think_s)
                r = turn(h, system, start)
                if r is None:
                    continue
                sess.append(r)
                nxt.append(r)
            if not nxt:
                break
            heads = nxt
        sess.sort(key=lambda r: r.t)
        sess = sess[: a.requests - n]
        n += len(sess)
        sessions.append(sess)
    return _rows(a, sessions, rng)


FAMILIES = {"docs": generate_docs, "chat": generate_chat}


# ------------------------------------------------------------------ statistics
def sharing_stats(rows: Iterable[dict]) -> dict:
    """Block-level sharing statistics of a Mooncake-format trace (any trace, not only these
    families): ``shared_requests`` (fraction of requests whose first block equals an earlier
    request's first block, i.e. that share a prefix with an earlier request), ``inside_fraction``
    (of the blocks shared that way, the fraction lying strictly inside an earlier prompt: no
    earlier request's full blocks end exactly where the shared prefix ends), ``mean_prompt`` and
    ``max_prompt`` tokens."""
    seen: dict = {}  # prefix hash -> True if some request's full blocks end exactly there
    n = shared_req = shared_blocks = inside_blocks = 0
    tokens, longest = 0, 0
    for r in rows:
        n += 1
        L, hs = r["input_length"], r["hash_ids"]
        tokens += L
        longest = max(longest, L)
        key, m, ends = 0, 0, False
        for h in hs:
            key = hash((key, h))
            if key not in seen:
                break
            m += 1
            ends = seen[key]
        if m:
            shared_req += 1
            shared_blocks += m
            inside_blocks += 0 if ends else m
        full = L // BLOCK
        key = 0
        for j, h in enumerate(hs):
            key = hash((key, h))
            seen[key] = seen.get(key, False) or j + 1 == full
    return {
        "requests": n,
        "mean_prompt": tokens / max(1, n),
        "max_prompt": longest,
        "shared_requests": shared_req / max(1, n),
        "inside_fraction": inside_blocks / max(1, shared_blocks),
    }


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------ CLI
def _range(g, name: str, lo: int, hi: int, what: str) -> None:
    g.add_argument(f"--{name}-min", type=int, default=lo, help=f"{what} from (default: %(default)s)")
    g.add_argument(f"--{name}-max", type=int, default=hi, help="upper end of the range above (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.suite_traces",
        description=__doc__.split("\n\n")[0] + " Writes one family's trace, or prints a trace's sharing statistics.",
        epilog="See the module docstring (benchmarks/suite_traces.py) for what each family produces. "
        "Replay a written trace with python -m benchmarks.trace_replay --trace OUT.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stats", help="print the sharing statistics of a Mooncake-format trace")
    st.add_argument("trace")
    for fam in FAMILIES:
        p = sub.add_parser(fam, help=f"write a {fam} trace", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--out", required=True, help="JSONL file to write (parent folders are created)")
        p.add_argument("--requests", type=int, default=4000, help="number of requests")
        p.add_argument("--seed", type=int, default=1, help="random seed; same seed + flags = same bytes")
        p.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, requests/s")
        p.add_argument("--max-prompt", type=int, default=131072, help="no prompt is longer (tokens)")
        p.add_argument("--think-s", type=float, default=30.0, help="mean gap between a turn's finish and the next")
        p.add_argument("--prefill-tokens-per-s", type=float, default=50000.0, help="modelled prefill speed")
        p.add_argument("--decode-ms-per-token", type=float, default=20.0, help="modelled decode speed")
        _range(p, "output", 50, 800, "output tokens, uniform,")
        if fam == "docs":
            p.add_argument("--docs-apps", type=int, default=24, help="applications (system prompt + document trie)")
            _range(p, "docs-system", 512, 4096, "system prompt tokens, uniform,")
            p.add_argument("--docs-private", type=float, default=0.82, help="share of requests that share nothing")
            p.add_argument(
                "--docs-private-median", type=int, default=4000, help="median tokens of a prompt that shares nothing"
            )
            p.add_argument("--docs-depth", type=float, default=3.0, help="mean documents per prompt (geometric)")
            p.add_argument("--docs-new-prob", type=float, default=0.15, help="chance a step takes a new document")
            p.add_argument("--docs-doc-median", type=int, default=8000, help="median document tokens (log-normal)")
            p.add_argument("--docs-doc-sigma", type=float, default=1.0, help="log-normal sigma of document length")
            _range(p, "docs-question", 64, 2048, "question tokens, log-uniform,")
            p.add_argument("--docs-followup-prob", type=float, default=0.35, help="chance of a follow-up turn")
            p.add_argument("--docs-max-turns", type=int, default=4, help="turns per session at most")
        else:
            p.add_argument("--chat-systems", type=int, default=3, help="shared system prompts")
            _range(p, "chat-system", 2048, 12288, "system prompt tokens, uniform,")
            p.add_argument("--chat-turns", type=int, default=6, help="turns per conversation at most (uniform 2..)")
            _range(p, "chat-msg", 64, 1024, "user message tokens, log-uniform,")
            p.add_argument("--chat-branch-prob", type=float, default=0.5, help="chance a conversation branches")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "stats":
        return a
    checks = [
        (a.requests >= 1, "--requests must be >= 1"),
        (a.rate > 0 and a.think_s > 0, "--rate and --think-s must be > 0"),
        (a.max_prompt >= 4 * BLOCK, f"--max-prompt must be >= {4 * BLOCK}"),
        (0 <= a.output_min <= a.output_max, "--output-min must be in [0, --output-max]"),
    ]
    if a.cmd == "docs":
        checks += [
            (a.docs_apps >= 1, "--docs-apps must be >= 1"),
            (0 <= a.docs_private <= 1 and 0 <= a.docs_new_prob <= 1, "probabilities must be in [0, 1]"),
            (0 <= a.docs_followup_prob < 1, "--docs-followup-prob must be in [0, 1)"),
            (a.docs_depth > 0 and a.docs_doc_median >= BLOCK, "--docs-depth > 0 and --docs-doc-median >= 512"),
            (1 <= a.docs_question_min <= a.docs_question_max, "--docs-question-min must be in [1, max]"),
            (BLOCK <= a.docs_system_min <= a.docs_system_max, "--docs-system-min must be in [512, max]"),
        ]
    else:
        checks += [
            (a.chat_systems >= 1 and a.chat_turns >= 2, "--chat-systems >= 1 and --chat-turns >= 2"),
            (0 <= a.chat_branch_prob <= 1, "--chat-branch-prob must be in [0, 1]"),
            (1 <= a.chat_msg_min <= a.chat_msg_max, "--chat-msg-min must be in [1, max]"),
            (BLOCK <= a.chat_system_min <= a.chat_system_max, "--chat-system-min must be in [512, max]"),
            (a.chat_system_max + BLOCK <= a.max_prompt, "--max-prompt must exceed --chat-system-max"),
        ]
    for ok, msg in checks:
        if not ok:
            ap.error(msg)
    if os.path.isdir(a.out):
        ap.error(f"--out is a directory, expected a file path: {a.out}")
    return a


def write(a) -> list[dict]:
    rows = FAMILIES[a.cmd](a)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _print_stats(s: dict) -> None:
    print(
        f"requests {s['requests']}, mean prompt {s['mean_prompt']:,.0f} tokens (max {s['max_prompt']:,}), "
        f"{s['shared_requests']:.1%} share a prefix with an earlier request, "
        f"{s['inside_fraction']:.1%} of shared blocks strictly inside an earlier prompt"
    )


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    if a.cmd == "stats":
        try:
            rows = read_rows(a.trace)
        except (OSError, ValueError) as e:
            print(f"error: cannot read {a.trace}: {e}", file=sys.stderr)
            return 2
        _print_stats(sharing_stats(rows))
        return 0
    try:
        rows = write(a)
    except OSError as e:
        print(f"error: cannot write --out {a.out}: {e}", file=sys.stderr)
        return 2
    print(f"suite_traces {a.cmd}: {len(rows)} requests -> {a.out} in {time.perf_counter() - t0:.1f}s (seed {a.seed})")
    _print_stats(sharing_stats(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
