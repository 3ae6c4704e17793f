"""Mooncake trace -> token sequences, deterministically, in a compact symbolic form.

Input format (one JSON object per line): ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (one id per 512-token block of the prompt; the last block holds
``input_length mod 512`` tokens, or 512 when that is 0).

How tokens are made
-------------------
A token is an *atom* ``(source, index)``. Two sources exist: the fresh content of hash block ``h``
(atoms ``(h, i)``, ``i`` = position inside the block) and the output of request ``r`` (atoms
``(r, j)``, ``j`` = output position). Equal atoms are equal tokens, distinct atoms are distinct
tokens, so prefix sharing is exactly what the ids say:

* **Equal hash ids give equal tokens.** The first time a hash id is seen its content is fixed and
  memoised; every later occurrence reuses it (truncated when it is a shorter last block, extended
  with fresh atoms ``(h, i)`` when a later request needs more of it).
* **Conversation turns.** In this trace the next turn's ``hash_ids`` repeat the previous turn's
  *full* blocks and then continue with new ids: the previous turn's partial last block is
  re-hashed because, in the real conversation, it was completed by the previous turn's prompt
  tail, its output and the new user message. (Checked on the shipped trace: of the requests that
  share blocks with an earlier one, 3841 share exactly the earlier request's full blocks.) So when
  a request ``r`` starts with all ``floor(L_p / 512)`` full blocks of an earlier request ``p``, its
  next block is new, and ``L_p + O_p <= L_r``, ``p`` is ``r``'s *parent* (the latest such request)
  and the new blocks of ``r`` are filled first with ``p``'s prompt atoms and then ``p``'s output atoms,
  exactly as the next turn sees them, then with fresh atoms. Those blocks are memoised under ``r``'s
  ids, so a third turn sees the same tokens. A request with no parent gets fresh atoms.
  A parent must share at least ``min_parent_blocks`` (default 2) full blocks: block 0 of this trace
  is one system prompt shared by all 12,031 requests, and "parents" that share only it are
  unrelated requests (median gap 3 s, against ~2 min for parents sharing 2+ blocks). So a
  conversation whose first turn is under 1024 tokens is not linked to its second turn (fewer hits
  for every policy, the oracle included).
* The sequence a finished request leaves behind is its prompt followed by its output atoms.

Symbolic scaling
----------------
Keeping 145 M token ids in a Python radix tree is too slow, so one *symbol* stands for ``unit``
(default 64 = the KDA chunk = the hit unit) consecutive real tokens at an absolute position that is a
multiple of ``unit``. A symbol's id is the hash of the canonical description of its atoms (maximal
runs ``(source, start, length)``), so two symbols are equal exactly when their tokens are (up to a
64-bit hash collision, probability ~1e-7 for this trace). A prompt of ``L`` tokens is
``ceil(L / unit)`` symbols; only the last one can be partial, and a partial symbol never equals a
full one. All hit lengths the tree returns are in symbols and are multiplied by ``unit`` to get real
tokens; every KDA restore lands on a multiple of 64 real tokens anyway, and MLA-only hits
(``fa-budget``, ``oracle``) are rounded down to 64 tokens like every other policy.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterable, Optional

BLOCK = 512
_OUT = 1  # low bit of a source id: 0 = hash block, 1 = request output


class TraceError(ValueError):
    """A trace file is missing or malformed (the message names the line)."""


@dataclass(frozen=True)
class TraceRequest:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple


def _fail(path: str, lineno: int, msg: str) -> TraceError:
    return TraceError(f"{path}:{lineno}: {msg}")


def load_trace(path: str, limit: Optional[int] = None, block: int = BLOCK) -> list[TraceRequest]:
    """Parse and validate a Mooncake JSONL trace. Blank lines are skipped."""
    if not os.path.exists(path):
        raise TraceError(f"trace file not found: {path}")
    if os.path.isdir(path):
        raise TraceError(f"trace path is a directory, expected a JSONL file: {path}")
    out: list[TraceRequest] = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _fail(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise _fail(path, lineno, "expected a JSON object")
            for k in ("timestamp", "input_length", "output_length", "hash_ids"):
                if k not in obj:
                    raise _fail(path, lineno, f"missing field '{k}'")
            ts, il, ol, hs = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise _fail(path, lineno, f"timestamp must be a finite number >= 0, got {ts!r}")
            if isinstance(il, bool) or not isinstance(il, int) or il < 1:
                raise _fail(path, lineno, f"input_length must be an integer >= 1, got {il!r}")
            if isinstance(ol, bool) or not isinstance(ol, int) or ol < 0:
                raise _fail(path, lineno, f"output_length must be an integer >= 0, got {ol!r}")
            if not isinstance(hs, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hs
            ):
                raise _fail(path, lineno, "hash_ids must be a list of integers >= 0")
            need = -(-il // block)
            if len(hs) != need:
                raise _fail(
                    path,
                    lineno,
                    f"hash_ids has {len(hs)} entries but input_length {il} needs ceil({il}/{block}) = {need}",
                )
            out.append(TraceRequest(lineno, float(ts), il, ol, tuple(hs)))
    if not out:
        raise TraceError(f"trace has no requests: {path}")
    return out


# ---------------------------------------------------------------------------------- atoms / runs
# A run is (source, start, end): atoms (source, start) .. (source, end - 1).


def _append(runs: list, src: int, a: int, b: int) -> None:
    if b <= a:
        return
    if runs and runs[-1][0] == src and runs[-1][2] == a:
        runs[-1] = (src, runs[-1][1], b)  # merge: canonical maximal runs
    else:
        runs.append((src, a, b))


def _slice(runs: list, starts: list, a: int, b: int) -> list:
    """Atoms [a, b) of a run list whose run i begins at offset starts[i]."""
    out: list = []
    i = bisect_right(starts, a) - 1
    while a < b and i < len(runs):
        src, s, e = runs[i]
        lo = s + (a - starts[i])
        take = min(e - lo, b - a)
        _append(out, src, lo, lo + take)
        a += take
        i += 1
    return out


def _starts(runs: list) -> list:
    out, pos = [], 0
    for _, s, e in runs:
        out.append(pos)
        pos += e - s
    return out


@dataclass
class SymbolicTrace:
    """The converted trace. ``seq[i]`` holds the symbols of request i's prompt + output
    (``ceil((L + O) / unit)``); its prompt is ``seq[i][:L // unit]`` plus ``prompt_last[i]`` when
    ``L % unit`` (the partial last symbol of the prompt alone), see :meth:`prompt`."""

    unit: int
    arrival_s: list = field(default_factory=list)
    input_len: list = field(default_factory=list)
    output_len: list = field(default_factory=list)
    seq: list = field(default_factory=list)
    prompt_last: list = field(default_factory=list)
    parent: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_len)

    def prompt(self, i: int) -> list:
        L, u = self.input_len[i], self.unit
        key = self.seq[i][: L // u].tolist()
        if L % u:
            key.append(self.prompt_last[i])
        return key

    def full(self, i: int) -> list:
        return self.seq[i].tolist()


def _symbols(runs: list, total: int, unit: int) -> array:
    out = array("q")
    ri, off = 0, 0
    for c in range(-(-total // unit)):
        need = min(unit, total - c * unit)
        parts = []
        while need:
            src, s, e = runs[ri]
            lo = s + off
            take = min(e - lo, need)
            parts.append(src)
            parts.append(lo)
            parts.append(take)
            need -= take
            if lo + take == e:
                ri, off = ri + 1, 0
            else:
                off += take
        out.append(hash(tuple(parts)))
    return out


def to_symbolic(
    reqs: Iterable[TraceRequest],
    unit: int = 64,
    block: int = BLOCK,
    timestamp_scale: float = 1e-3,
    min_parent_blocks: int = 2,
) -> SymbolicTrace:
    """Convert validated requests (in trace order, stably sorted by timestamp) to symbols."""
    reqs = sorted(reqs, key=lambda r: r.timestamp)
    memo: dict[int, list] = {}  # hash id -> runs of its (possibly partial) block content
    trie: dict[tuple, int] = {}  # (prefix id, hash id) -> prefix id
    by_full_prefix: dict[int, list] = {}  # prefix id of a request's full blocks -> requests
    seq_runs: list[list] = []  # per request: runs of prompt + output
    st = SymbolicTrace(unit=unit)
    for i, r in enumerate(reqs):
        L, O, hs = r.input_length, r.output_length, r.hash_ids
        # leading blocks already known, and the prefix ids of this request's blocks
        pids, pid, known = [], 0, 0
        for b, h in enumerate(hs):
            pid = trie.setdefault((pid, h), len(trie) + 1)
            pids.append(pid)
            if known == b and h in memo:
                known += 1
        parent = -1
        if known >= min_parent_blocks:
            for p in reversed(by_full_prefix.get(pids[known - 1], [])):
                q = reqs[p]
                if q.input_length + q.output_length <= L:
                    parent = p
                    break
        p_runs = seq_runs[parent] if parent >= 0 else None
        p_starts = _starts(p_runs) if p_runs is not None else None
        p_len = (reqs[parent].input_length + reqs[parent].output_length) if parent >= 0 else 0
        runs: list = []
        for b, h in enumerate(hs):
            n = block if b < len(hs) - 1 else L - block * (len(hs) - 1)
            content = memo.get(h)
            if content is None:
                content = []
                if p_runs is not None and b * block < p_len:
                    for run in _slice(p_runs, p_starts, b * block, min(b * block + n, p_len)):
                        _append(content, *run)
                have = sum(e - s for _, s, e in content)
                _append(content, 2 * h, have, n)  # fresh atoms (h, i), i = position in block
                memo[h] = content
            else:
                have = sum(e - s for _, s, e in content)
                if have < n:  # a later request needs more of this block: extend, keep prefix
                    content = list(content)
                    _append(content, 2 * h, have, n)
                    memo[h] = content
            for run in _slice(content, _starts(content), 0, n):
                _append(runs, *run)
        full_blocks = L // block
        if full_blocks:
            by_full_prefix.setdefault(pids[full_blocks - 1], []).append(i)
        prompt_runs = list(runs)
        _append(runs, 2 * i + _OUT, 0, O)
        seq_runs.append(runs)
        st.arrival_s.append(r.timestamp * timestamp_scale)
        st.input_len.append(L)
        st.output_len.append(O)
        st.parent.append(parent)
        st.seq.append(_symbols(runs, L + O, unit))
        if L % unit:
            tail = _slice(prompt_runs, _starts(prompt_runs), L // unit * unit, L)
            st.prompt_last.append(_symbols(tail, L % unit, unit)[0])
        else:
            st.prompt_last.append(0)
    return st
