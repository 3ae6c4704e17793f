"""Fork-heavy synthetic trace generator, Mooncake JSONL format.

    python -m benchmarks.fork_trace --out /tmp/fork.jsonl [--requests 3000 --seed 0 ...]
    python -m benchmarks.trace_replay --trace /tmp/fork.jsonl --policies oracle --budgets-gib 40

Writes one JSON object per line, exactly the fields of ``../shared/data/mooncake_conversation_trace.jsonl``:
``timestamp`` (integer ms, non-decreasing), ``input_length``, ``output_length`` and ``hash_ids`` (one id
per 512-token block of the prompt, the last block possibly partial). Its sharing structure is meant
to be read through ``benchmarks/trace/mooncake.py`` (read that docstring first): equal hash ids are
equal tokens, and a request ``r`` that starts with *all* full blocks of an earlier request ``p`` and
then has new ids, with ``L_p + O_p <= L_r``, is ``p``'s next turn: its new blocks hold ``p``'s prompt
tail, then ``p``'s output, then fresh tokens (the parent is the latest such ``p``, and it must share
at least 2 full blocks). Every request below is built on that rule, so the token-level sharing after
conversion is exactly the one described here.

Scenario families (each session belongs to one; ``--share-*`` sets each family's share of requests)
-----------------------------------------------------------------------------------------------------
``agent`` -- agents and tools sharing long prefixes. ``--agent-prefixes`` system/tool-definition
  prefixes of ``--agent-prefix-min..max`` tokens (whole blocks; popularity 1/rank) are shared by every
  agent session that uses them. A session is ``prefix + task`` (``--agent-task-*``) followed by
  1..``--agent-turns`` tool-call turns; each turn is the previous turn's prompt + its output (the tool
  call) + a tool result (``--tool-result-*``), linked through the turn rule, and arrives after the
  previous turn's modelled finish + an exponential tool latency (``--tool-latency-s``). Forks: every
  first turn diverges from the other sessions at the end of its shared prefix, every turn extends
  its parent at a point that is not block-aligned (after the parent's output).
``edit`` -- chat with regenerate and edit. A conversation starts with the shared chat system prompt
  (``--chat-system-tokens``, whole blocks) + a first message and runs for 2..``--chat-turns``
  requests. After the first, each request is, with ``--regen-prob``, a *regenerate*: the exact
  prompt (identical ``hash_ids``) of the current turn or, half the time, of a random request of the
  conversation so far, with a new output, and the conversation goes on from that answer; with
  ``--edit-prob``, an *edit*: an earlier request ``q`` of the conversation is picked, its ``hash_ids``
  are kept up to a random block boundary ``k`` strictly inside ``q``'s prompt (not before the end of
  the system prompt, before ``q``'s last full block), then new ids follow (the edited message, at
  least 512 tokens, ``--chat-first-*``), so the edit forks inside ``q``'s prompt; the conversation
  then continues on the new branch. Otherwise it is a normal next turn of the current branch.
  Where ``k`` is exactly the full-block count of an earlier request ``a`` of the conversation, the
  turn rule links the edit to ``a`` (it then also shares ``a``'s output: an edit of the message that
  followed ``a``). Requests arrive one after the other, each after the previous one's modelled
  finish + an exponential think time (``--think-s``).
``tot`` -- tree-of-thought search. A root prompt (``--tot-root-*``); each node gets
  ``--tot-branches`` children, level by level, down to ``--tot-depth``; a child is its node's prompt +
  the node's output (the thought it expands) + a short branch instruction (``--tot-suffix-*``),
  linked through the turn rule, and generates its own output. With probability
  ``1 - --tot-root-output-prob`` the root is a prefill-only request (output 0, as SGLang's frontend
  sends before a fork) and the first level shares only the root prompt. Siblings arrive together,
  ``--tot-gap-s`` after their node's modelled finish. Every node is a fork point of ``k`` branches,
  at ``L + O`` of the node (``L`` for a prefill-only root), usually inside a block.
``fork`` -- SGLang frontend ``fork`` programs. A program prompt ``P`` (``--fork-prompt-*``) is sent as a
  prefill-only request (``max_new_tokens=0``: SGLang's ``commit_lazy_operations`` before
  ``s.fork(n)``), then ``--fork-n`` branches arrive together, each ``P`` + its own short suffix
  (``--fork-suffix-*``, new ids) and generate; with ``--fork-join-prob`` a join turn follows the
  last branch: ``P`` + the branches' outputs + an instruction (new tokens). All branches fork at the
  same unaligned position ``L_P``.

Why fork-heavy: besides the shared prefixes, most requests branch off an earlier request at a
position *inside* a 512-token block and usually not on a 64-token boundary either (after a
prompt tail + output, after an edit, after a fork prompt), and many siblings share the same
branch point; so a cache that can only resume at some positions (recurrent-state checkpoints) is
tested much harder than by linear conversations.

Every request has at least one full block of its own beyond the blocks it copies (its new part is
lengthened when needed). This keeps the conversion's parent rule unambiguous: a request's full
blocks identify it (and its exact regenerates), so each turn links to the request it was built
from; ``generate`` records that designed parent and the summary checks it against the conversion.
Every request is at least 1024 tokens, so every turn can link (2 full blocks).

Arrivals: sessions start as a Poisson process at ``--rate * sessions / requests`` per second, so
requests arrive at ``--rate`` per second on average (the trace runs somewhat past
``requests / rate``: the last sessions' later turns); requests within a session follow the delays
above, with a request's modelled finish =
arrival + ``L / --prefill-tokens-per-s`` + ``O * --decode-ms-per-token`` (20 ms, trace_replay's
default), so a next turn comes after its parent finished unless the replayed engine queues. All
randomness comes from ``--seed``: the same seed and flags give a byte-identical file. Hash ids are
numbered in order of first appearance, as in the Mooncake trace.

Output: the JSONL file, a progress line on stderr and a summary on stdout (requests, prompt tokens,
each family's share of requests and prompt tokens, request kinds, the fraction of prompt tokens
equal to a prefix of an earlier request's prompt or prompt + output after conversion -- the hit rate
of an unlimited cache that never waits -- and how many parent links the conversion makes as
designed). From Python: ``generate(parse_args([...]))`` returns the rows with each request's family,
kind, designed parent and origin; ``prefix_stats`` measures the sharing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

BLOCK = 512
FAMILIES = ("agent", "edit", "tot", "fork")
KINDS = ("first", "turn", "regen", "edit", "root", "commit", "branch", "join")
MIN_REQUEST = 2 * BLOCK  # mooncake.py links a turn only when it shares >= 2 full blocks

# prompt-length flags that --length-scale multiplies, with the floor each needs afterwards
_SCALED = {
    "agent_prefix_min": BLOCK,
    "agent_prefix_max": BLOCK,
    "agent_task_min": 1,
    "agent_task_max": 1,
    "tool_result_min": 1,
    "tool_result_max": 1,
    "chat_system_tokens": 0,
    "chat_first_min": 1,
    "chat_first_max": 1,
    "chat_msg_min": 1,
    "chat_msg_max": 1,
    "tot_root_min": MIN_REQUEST,
    "tot_root_max": MIN_REQUEST,
    "tot_suffix_min": 1,
    "tot_suffix_max": 1,
    "fork_prompt_min": MIN_REQUEST,
    "fork_prompt_max": MIN_REQUEST,
    "fork_suffix_min": 1,
    "fork_suffix_max": 1,
}


def _nblocks(L: int) -> int:
    return -(-L // BLOCK)


class _Req:
    __slots__ = ("ids", "L", "O", "kind", "t", "parent", "origin", "kept", "family", "session", "gen")

    def __init__(self, ids, L, O, kind, t, parent=None, origin=None, kept=0):
        self.ids, self.L, self.O, self.kind, self.t = ids, L, O, kind, t
        self.parent, self.origin, self.kept = parent, origin, kept
        self.family, self.session, self.gen = "", -1, -1

    @property
    def full(self) -> int:
        return self.L // BLOCK


@dataclass
class GeneratedTrace:
    """The trace in file order. ``parent[i]``: the request the conversion's turn rule must link ``i``
    to (-1: none); ``origin[i]``: the request ``i`` continues, regenerates, edits or branches from
    (-1: none); ``kept[i]``: how many leading hash blocks ``i`` copies from earlier requests."""

    rows: list = field(default_factory=list)
    family: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    session: list = field(default_factory=list)
    parent: list = field(default_factory=list)
    origin: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    sessions: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def dumps(self) -> str:
        return "".join(json.dumps(r) + "\n" for r in self.rows)


class _Builder:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.next_id = 0
        lo, hi = max(1, a.agent_prefix_min // BLOCK), max(1, a.agent_prefix_max // BLOCK)
        self.prefixes = [self._new(self.rng.randint(lo, hi)) for _ in range(a.agent_prefixes)]
        self.prefix_weights = [1.0 / (i + 1) for i in range(a.agent_prefixes)]
        self.chat_system = self._new(a.chat_system_tokens // BLOCK)

    # ------------------------------------------------------------------ helpers
    def _new(self, n: int) -> list:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _loguni(self, lo: int, hi: int) -> int:
        if lo >= hi:
            return lo
        return min(hi, max(lo, int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))))

    def _out(self) -> int:
        return self.rng.randint(self.a.output_min, self.a.output_max)

    def _finish(self, r: _Req) -> float:
        """Modelled finish time (s, session-relative) of r."""
        return r.t + r.L / self.a.prefill_tokens_per_s + r.O * self.a.decode_ms_per_token / 1e3

    def _make(self, kept_ids: list, L: int, O: int, kind: str, t: float, parent=None, origin=None) -> _Req:
        return _Req(
            list(kept_ids) + self._new(_nblocks(L) - len(kept_ids)), L, O, kind, t, parent, origin, len(kept_ids)
        )

    @staticmethod
    def _own(carry: int, kept_blocks: int, m: int) -> int:
        """Prompt length of a request that copies ``carry`` tokens (``kept_blocks`` whole blocks of them
        as hash ids) and adds ``m`` new ones, lengthened to own at least one full block."""
        return max(carry + m, (kept_blocks + 1) * BLOCK)

    def _turn(self, p: _Req, m: int, kind: str, t: float) -> Optional[_Req]:
        """The next turn of p: p's prompt + output + m new tokens, linked through the turn rule."""
        L = self._own(p.L + p.O, p.full, m)
        if self.a.max_prompt < L:
            return None
        return self._make(p.ids[: p.full], L, self._out(), kind, t, parent=p, origin=p)

    # ------------------------------------------------------------------ families
    def agent(self) -> list:
        a, rng = self.a, self.rng
        pre = rng.choices(self.prefixes, weights=self.prefix_weights)[0]
        L = min(self._own(len(pre) * BLOCK, len(pre), self._loguni(a.agent_task_min, a.agent_task_max)), a.max_prompt)
        head = self._make(pre, L, self._out(), "first", 0.0)
        out = [head]
        for _ in range(rng.randint(min(1, a.agent_turns), a.agent_turns)):
            t = self._finish(head) + (rng.expovariate(1.0 / a.tool_latency_s) if a.tool_latency_s > 0 else 0.0)
            r = self._turn(head, self._loguni(a.tool_result_min, a.tool_result_max), "turn", t)
            if r is None:
                break
            out.append(r)
            head = r
        return out

    def edit(self) -> list:
        a, rng = self.a, self.rng
        sys_ids = self.chat_system
        sysL = len(sys_ids) * BLOCK
        m = self._loguni(a.chat_first_min, a.chat_first_max)
        L = min(max(self._own(sysL, len(sys_ids), m), MIN_REQUEST), a.max_prompt)
        head = self._make(sys_ids, L, self._out(), "first", 0.0)
        hist = [head]
        k_lo = max(1, len(sys_ids))  # edits keep at least the system prompt (and one block)
        for _ in range(rng.randint(2, a.chat_turns) - 1):
            prev = hist[-1]
            t = self._finish(prev) + (rng.expovariate(1.0 / a.think_s) if a.think_s > 0 else 0.0)
            u = rng.random()
            r = None
            if u < a.regen_prob:
                q = head if rng.random() < 0.5 else rng.choice(hist)
                r = _Req(list(q.ids), q.L, self._out(), "regen", t, None, q, len(q.ids))
            elif u < a.regen_prob + a.edit_prob:
                cands = [q for q in hist if q.full - 1 >= k_lo]
                if cands:
                    q = rng.choice(cands)
                    k = rng.randint(k_lo, q.full - 1)
                    L = min(self._own(k * BLOCK, k, self._loguni(a.chat_first_min, a.chat_first_max)), a.max_prompt)
                    # the conversion's rule: the latest earlier request whose full blocks are exactly
                    # q's first k blocks, if its prompt + output fit (edits always own a block, so
                    # only requests of this conversation can match)
                    parent = None
                    if k >= 2:
                        for h in reversed(hist):
                            if h.full == k and h.ids[:k] == q.ids[:k] and h.L + h.O <= L:
                                parent = h
                                break
                    r = self._make(q.ids[:k], L, self._out(), "edit", t, parent, q)
            if r is None:
                r = self._turn(head, self._loguni(a.chat_msg_min, a.chat_msg_max), "turn", t)
                if r is None:
                    break
            hist.append(r)
            head = r
        return hist

    def tot(self) -> list:
        a, rng = self.a, self.rng
        O = self._out() if rng.random() < a.tot_root_output_prob else 0
        root = self._make([], self._loguni(a.tot_root_min, a.tot_root_max), O, "root" if O else "commit", 0.0)
        out, frontier = [root], [root]
        for _ in range(a.tot_depth):
            nxt = []
            for node in frontier:
                t = self._finish(node) + a.tot_gap_s
                for _ in range(a.tot_branches):
                    r = self._turn(node, self._loguni(a.tot_suffix_min, a.tot_suffix_max), "branch", t)
                    if r is not None:
                        nxt.append(r)
            out.extend(nxt)
            frontier = nxt
        return out

    def fork(self) -> list:
        a, rng = self.a, self.rng
        P = self._make([], self._loguni(a.fork_prompt_min, a.fork_prompt_max), 0, "commit", 0.0)
        out = [P]
        t = self._finish(P)
        for _ in range(a.fork_n):
            r = self._turn(P, self._loguni(a.fork_suffix_min, a.fork_suffix_max), "branch", t)
            if r is not None:
                out.append(r)
        if len(out) > 1 and rng.random() < a.fork_join_prob:
            t = max(self._finish(b) for b in out[1:]) + 0.05
            m = sum(b.O for b in out[1:]) + self._loguni(a.fork_suffix_min, a.fork_suffix_max)
            r = self._turn(P, m, "join", t)
            if r is not None:
                out.append(r)
        return out


def generate(a, progress=None) -> GeneratedTrace:
    """Build the trace for parsed arguments ``a`` (see :func:`parse_args`)."""
    b = _Builder(a)
    total_share = sum(getattr(a, f"share_{f}") for f in FAMILIES)
    target = {f: getattr(a, f"share_{f}") / total_share for f in FAMILIES}
    count = dict.fromkeys(FAMILIES, 0)
    sessions: list = []
    n = 0
    while n < a.requests:
        # the family furthest below its share of requests (ties: FAMILIES order)
        fam = max((f for f in FAMILIES if target[f] > 0), key=lambda f: target[f] * (n + 1) - count[f])
        reqs = getattr(b, fam)()[: a.requests - n]
        for r in reqs:
            r.family, r.session, r.gen = fam, len(sessions), n
            n += 1
        count[fam] += len(reqs)
        sessions.append(reqs)
        if progress is not None:
            progress(n)
    # session starts: Poisson, at the rate that makes the whole trace average --rate requests/s
    rate_s = a.rate * len(sessions) / n
    rows = []
    start = 0.0
    for i, reqs in enumerate(sessions):
        if i:
            start += b.rng.expovariate(rate_s)
        for r in reqs:
            rows.append((int(round((start + r.t) * 1000)), r.gen, r))
    rows.sort(key=lambda x: (x[0], x[1]))
    index = {r.gen: i for i, (_, _, r) in enumerate(rows)}
    renum: dict = {}
    g = GeneratedTrace(sessions=len(sessions))
    for ts, _, r in rows:
        ids = [renum.setdefault(h, len(renum)) for h in r.ids]
        g.rows.append({"timestamp": ts, "input_length": r.L, "output_length": r.O, "hash_ids": ids})
        g.family.append(r.family)
        g.kind.append(r.kind)
        g.session.append(r.session)
        g.parent.append(index[r.parent.gen] if r.parent is not None else -1)
        g.origin.append(index[r.origin.gen] if r.origin is not None else -1)
        g.kept.append(r.kept)
    return g


def prefix_stats(g: GeneratedTrace, unit: int = 64) -> dict:
    """Convert with ``benchmarks.trace.to_symbolic`` and measure, per request, the longest prefix of its
    prompt that equals a prefix of an earlier request's prompt or prompt + output (in ``unit`` steps),
    and whether the conversion's parent links are the designed ones."""
    from benchmarks.trace.mooncake import TraceRequest, to_symbolic

    reqs = [
        TraceRequest(i + 1, float(r["timestamp"]), r["input_length"], r["output_length"], tuple(r["hash_ids"]))
        for i, r in enumerate(g.rows)
    ]
    st = to_symbolic(reqs, unit=unit)
    seen: set = set()
    shared = 0
    for i in range(len(st)):
        L = st.input_len[i]
        key, m = 0, 0
        for s in st.prompt(i):
            key = hash((key, s))
            if key not in seen:
                break
            m += 1
        shared += min(m * unit, L)
        key = 0
        for j, s in enumerate(st.seq[i]):
            if j == L // unit and L % unit:
                seen.add(hash((key, st.prompt_last[i])))
            key = hash((key, s))
            seen.add(key)
    prompt = sum(st.input_len)
    return {
        "shared_prefix_tokens": shared,
        "shared_prefix_fraction": shared / prompt if prompt else 0.0,
        "linked": sum(1 for p in st.parent if p >= 0),
        "links_as_designed": sum(1 for x, y in zip(st.parent, g.parent) if x == y),
        "parent": list(st.parent),
    }


def summary(g: GeneratedTrace, stats: Optional[dict]) -> str:
    rows = g.rows
    n = len(rows)
    P = sum(r["input_length"] for r in rows)
    O = sum(r["output_length"] for r in rows)
    dur = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1e3
    lines = [
        f"requests            {n} in {g.sessions} sessions over {dur:.0f} s ({n / max(dur, 1e-9):.2f} req/s)",
        f"prompt tokens       {P:,} (mean {P / n:,.0f}, max {max(r['input_length'] for r in rows):,}); "
        f"output tokens {O:,}",
    ]
    for f in FAMILIES:
        k = sum(1 for x in g.family if x == f)
        pt = sum(r["input_length"] for r, x in zip(rows, g.family) if x == f)
        lines.append(f"  {f:<6} {k:>6} requests ({k / n:6.1%}), {pt / max(P, 1):6.1%} of prompt tokens")
    kinds = {k: sum(1 for x in g.kind if x == k) for k in KINDS}
    lines.append("kinds               " + ", ".join(f"{k} {v}" for k, v in kinds.items() if v))
    if stats is not None:
        lines.append(
            f"shared prefix       {stats['shared_prefix_fraction']:.1%} of prompt tokens share a prefix with "
            f"an earlier request ({stats['shared_prefix_tokens']:,} tokens, 64-token steps)"
        )
        lines.append(
            f"turn links          {stats['linked']} requests continue an earlier one after conversion; "
            f"{stats['links_as_designed']}/{n} parent links as designed"
        )
    return "\n".join(lines)


def _range(g, name: str, lo: int, hi: int, what: str) -> None:
    """``--NAME-min`` and ``--NAME-max``: an integer range (``what`` says what it draws and how)."""
    g.add_argument(f"--{name}-min", type=int, default=lo, help=f"{what} from (default: %(default)s)")
    g.add_argument(f"--{name}-max", type=int, default=hi, help="upper end of the range above (default: %(default)s)")


# ------------------------------------------------------------------ CLI
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.fork_trace",
        description=__doc__.split("\n\n")[0] + " Mixes agent/tool prefixes, chat regenerate/edit, "
        "tree-of-thought and SGLang fork programs; see the module docstring (benchmarks/fork_trace.py) "
        "for exactly what each family produces. Replay with python -m benchmarks.trace_replay --trace OUT.",
        epilog="Lengths are in tokens. Every request's new part is lengthened where needed so that it "
        "completes at least one 512-token block of its own, and every request is >= 1024 tokens; this "
        "keeps mooncake.py's turn rule unambiguous (see the module docstring). Prints a progress line "
        "on stderr and a summary on stdout (requests, prompt tokens, each scenario's share, the "
        "fraction of prompt tokens that share a prefix with an earlier request, turn links).",
    )
    g = ap.add_argument_group("output and size")
    g.add_argument("--out", required=True, help="JSONL file to write (parent folders are created)")
    g.add_argument("--requests", type=int, default=3000, help="number of requests (default: %(default)s)")
    g.add_argument(
        "--seed", type=int, default=0, help="random seed; same seed + flags = same bytes (default: %(default)s)"
    )
    g.add_argument(
        "--rate",
        type=float,
        default=2.0,
        help="mean arrival rate, requests/s: sessions start as a Poisson process at the rate that gives "
        "this many requests/s on average (the trace runs a little longer than requests/rate: the last "
        "sessions' later turns) (default: %(default)s)",
    )
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply every prompt-length knob below (not outputs or --max-prompt); prefixes stay >= 512 "
        "and roots/fork prompts >= 1024 tokens (default: %(default)s)",
    )
    g.add_argument("--max-prompt", type=int, default=65536, help="no prompt is longer (default: %(default)s)")
    _range(g, "output", 100, 800, "output length, uniform")
    g.add_argument(
        "--no-stats",
        action="store_true",
        help="skip the conversion that measures prefix sharing for the summary",
    )
    g = ap.add_argument_group("scenario shares (relative weights of requests, >= 0, not all 0)")
    g.add_argument(
        "--share-agent", type=float, default=0.3, help="agents/tools on long shared prefixes (default: %(default)s)"
    )
    g.add_argument("--share-edit", type=float, default=0.3, help="chat with regenerate and edit (default: %(default)s)")
    g.add_argument("--share-tot", type=float, default=0.2, help="tree-of-thought branching (default: %(default)s)")
    g.add_argument("--share-fork", type=float, default=0.2, help="SGLang frontend fork programs (default: %(default)s)")
    g = ap.add_argument_group("timing model (when a session's next request arrives)")
    g.add_argument(
        "--prefill-tokens-per-s", type=float, default=50000.0, help="modelled prefill speed (default: %(default)s)"
    )
    g.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=20.0,
        help="modelled decode time per output token (default: %(default)s)",
    )
    g = ap.add_argument_group("agent")
    g.add_argument(
        "--agent-prefixes", type=int, default=4, help="number of shared system/tool prefixes (default: %(default)s)"
    )
    _range(g, "agent-prefix", 4096, 32768, "prefix tokens, whole blocks,")
    _range(g, "agent-task", 512, 4096, "task tokens after the prefix, log-uniform")
    g.add_argument(
        "--agent-turns", type=int, default=8, help="tool-call turns per session, uniform 1.. (default: %(default)s)"
    )
    _range(g, "tool-result", 64, 4096, "tool result tokens, log-uniform")
    g.add_argument(
        "--tool-latency-s",
        type=float,
        default=2.0,
        help="mean tool latency before the next turn (default: %(default)s)",
    )
    g = ap.add_argument_group("edit (chat with regenerate / edit)")
    g.add_argument(
        "--chat-system-tokens",
        type=int,
        default=1024,
        help="shared chat system prompt, whole blocks (default: %(default)s)",
    )
    _range(g, "chat-first", 512, 8192, "first / edited message tokens, log-uniform")
    _range(g, "chat-msg", 32, 2048, "later user message tokens, log-uniform")
    g.add_argument(
        "--chat-turns", type=int, default=12, help="requests per conversation, uniform 2.. (default: %(default)s)"
    )
    g.add_argument(
        "--think-s", type=float, default=20.0, help="mean user think time between requests (default: %(default)s)"
    )
    g.add_argument(
        "--regen-prob", type=float, default=0.15, help="chance a request is a regenerate (default: %(default)s)"
    )
    g.add_argument("--edit-prob", type=float, default=0.25, help="chance a request is an edit (default: %(default)s)")
    g = ap.add_argument_group("tot (tree of thought)")
    g.add_argument("--tot-branches", type=int, default=3, help="children per node (default: %(default)s)")
    g.add_argument("--tot-depth", type=int, default=2, help="levels of branching below the root (default: %(default)s)")
    _range(g, "tot-root", 1024, 16384, "root prompt tokens, log-uniform")
    _range(g, "tot-suffix", 16, 256, "branch instruction tokens, log-uniform")
    g.add_argument(
        "--tot-root-output-prob",
        type=float,
        default=0.5,
        help="chance the first level extends the root's output; otherwise the root is prefill-only "
        "and the first level shares only its prompt (default: %(default)s)",
    )
    g.add_argument(
        "--tot-gap-s", type=float, default=0.2, help="delay from a node's finish to its children (default: %(default)s)"
    )
    g = ap.add_argument_group("fork (SGLang frontend fork programs)")
    g.add_argument("--fork-n", type=int, default=4, help="parallel branches per fork (default: %(default)s)")
    _range(g, "fork-prompt", 1024, 16384, "shared program prompt tokens, log-uniform")
    _range(g, "fork-suffix", 16, 256, "branch suffix tokens, log-uniform")
    g.add_argument(
        "--fork-join-prob",
        type=float,
        default=0.5,
        help="chance of a join turn after the branches (default: %(default)s)",
    )
    a = ap.parse_args(argv)
    _validate(ap, a)
    return a


def _validate(ap, a) -> None:
    def bad(msg):
        ap.error(msg)

    if a.requests < 1:
        bad(f"--requests must be >= 1, got {a.requests}")
    floats = [
        "rate",
        "length_scale",
        "prefill_tokens_per_s",
        "decode_ms_per_token",
        "tool_latency_s",
        "think_s",
        "tot_gap_s",
        "regen_prob",
        "edit_prob",
        "tot_root_output_prob",
        "fork_join_prob",
    ] + [f"share_{f}" for f in FAMILIES]
    for k in floats:
        v = getattr(a, k)
        if not math.isfinite(v) or v < 0:
            bad(f"--{k.replace('_', '-')} must be a finite number >= 0, got {v}")
    for k in ("rate", "length_scale", "prefill_tokens_per_s"):
        if getattr(a, k) <= 0:
            bad(f"--{k.replace('_', '-')} must be > 0, got {getattr(a, k)}")
    if sum(getattr(a, f"share_{f}") for f in FAMILIES) <= 0:
        bad("the --share-* flags are all 0: at least one scenario needs a positive share")
    for k in ("regen_prob", "edit_prob", "tot_root_output_prob", "fork_join_prob"):
        if getattr(a, k) > 1:
            bad(f"--{k.replace('_', '-')} must be in [0, 1], got {getattr(a, k)}")
    if a.regen_prob + a.edit_prob > 1:
        bad(f"--regen-prob + --edit-prob must be <= 1, got {a.regen_prob + a.edit_prob}")
    ints = {
        "agent_prefixes": 1,
        "agent_turns": 0,
        "chat_turns": 2,
        "tot_branches": 1,
        "tot_depth": 1,
        "fork_n": 2,
        "output_min": 1,
        "chat_system_tokens": 0,
    }
    for k, lo in ints.items():
        if getattr(a, k) < lo:
            bad(f"--{k.replace('_', '-')} must be >= {lo}, got {getattr(a, k)}")
    if a.tot_branches**a.tot_depth > 100_000:
        bad(f"--tot-branches ** --tot-depth = {a.tot_branches**a.tot_depth} nodes per tree is too many (max 100000)")
    pairs = ["output", "agent_prefix", "agent_task", "tool_result", "chat_first", "chat_msg", "tot_root"]
    pairs += ["tot_suffix", "fork_prompt", "fork_suffix"]
    for p in pairs:
        lo, hi = getattr(a, p + "_min"), getattr(a, p + "_max")
        name = "--" + p.replace("_", "-")
        if lo < 1:
            bad(f"{name}-min must be >= 1, got {lo}")
        if hi < lo:
            bad(f"{name}-max ({hi}) must be >= {name}-min ({lo})")
    for k, floor in _SCALED.items():
        v = getattr(a, k)
        if a.length_scale != 1.0:
            v = int(round(v * a.length_scale))
        setattr(a, k, max(v, floor))
    need = {
        "--agent-prefix-max + 512": a.agent_prefix_max // BLOCK * BLOCK + BLOCK,
        "--chat-system-tokens + 512": max(a.chat_system_tokens // BLOCK * BLOCK + BLOCK, MIN_REQUEST),
        "--tot-root-max": a.tot_root_max,
        "--fork-prompt-max": a.fork_prompt_max,
    }
    for what, v in need.items():
        if a.max_prompt < v:
            bad(f"--max-prompt ({a.max_prompt}) must be >= {what} (= {v} after --length-scale)")
    if os.path.isdir(a.out):
        bad(f"--out is a directory, expected a file path: {a.out}")


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    last = [0.0]

    def progress(n):
        now = time.perf_counter()
        if tty and (now - last[0] > 0.2 or n >= a.requests):
            last[0] = now
            sys.stderr.write(f"\rfork_trace: {n}/{a.requests} requests")
            sys.stderr.flush()

    g = generate(a, progress)
    text = g.dumps()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        print(f"{chr(10) if tty else ''}error: cannot write --out {a.out}: {e}", file=sys.stderr)
        return 2
    print(
        f"{chr(13) if tty else ''}fork_trace: {len(g)}/{a.requests} requests, {g.sessions} sessions -> {a.out} "
        f"({len(text) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s"
        + ("" if a.no_stats else "; converting with mooncake.py for the summary"),
        file=sys.stderr,
        flush=True,
    )
    stats = None if a.no_stats else prefix_stats(g)
    print(summary(g, stats))
    print(f"done in {time.perf_counter() - t0:.1f}s (seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
