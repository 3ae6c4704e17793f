"""The three live workloads. Each runs against one server URL and returns
``(metrics, outputs)``: metrics per :func:`benchmarks.live.client.summarize`, outputs a dict
request key -> greedy output token ids (compared across caches)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from benchmarks.live.client import Progress, Result, generate_stream, per_request, summarize, summarize_results
from benchmarks.trace.mooncake import BLOCK, TraceRequest, load_trace, to_symbolic


def vocabulary(tokenizer_path: str) -> list[int]:
    """Token ids a synthetic prompt may use: the tokenizer's base vocabulary minus special ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    special = set(tok.all_special_ids or [])
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    if not vocab:
        raise RuntimeError(f"tokenizer {tokenizer_path} has no non-special tokens")
    return vocab


# ----------------------------------------------------------------------------- bench_serving
def run_bench_serving(
    url: str,
    label: str,
    tokenizer: str,
    *,
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    concurrency: int,
    seed: int,
    log_dir: str,
    verbose: bool = True,
) -> tuple[dict, dict]:
    """SGLang's own ``python -m sglang.bench_serving --dataset-name generated-shared-prefix``,
    one run; reads its JSONL output (``--output-details --cache-report``). It warms up with one
    request and flushes the cache (``--flush-cache``) before measuring."""
    os.makedirs(log_dir, exist_ok=True)
    out_file = os.path.join(log_dir, f"bench_serving_{label}.jsonl")
    log_file = os.path.join(log_dir, f"bench_serving_{label}.log")
    if os.path.exists(out_file):
        os.remove(out_file)
    n = groups * prompts_per_group
    cmd = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--dataset-name",
        "generated-shared-prefix",
        "--tokenizer",
        tokenizer,
        "--model",
        tokenizer,
        "--gsp-num-groups",
        str(groups),
        "--gsp-prompts-per-group",
        str(prompts_per_group),
        "--gsp-system-prompt-len",
        str(system_len),
        "--gsp-question-len",
        str(question_len),
        "--gsp-output-len",
        str(output_len),
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        str(seed),
        "--output-file",
        out_file,
        "--output-details",
        "--cache-report",
        "--flush-cache",
        "--warmup-requests",
        "1",
        "--disable-tqdm",
    ]
    if verbose:
        print(
            f"  [{label}] bench_serving: {n} prompts ({groups} groups x {prompts_per_group}), log {log_file}",
            flush=True,
        )
    t0 = time.time()
    with open(log_file, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not os.path.exists(out_file):
        with open(log_file) as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"bench_serving failed (exit {proc.returncode}) against {label}:\n{tail}")
    with open(out_file) as f:
        rec = json.loads([ln for ln in f if ln.strip()][-1])
    errors = [e for e in rec.get("errors", []) if e]
    ok = [i for i, e in enumerate(rec.get("errors", [""] * len(rec["ttfts"]))) if not e]
    metrics = summarize(
        [rec["ttfts"][i] for i in ok],
        sum(rec["input_lens"][i] for i in ok),
        sum(rec["cached_tokens"][i] for i in ok),
        sum(rec["output_lens"][i] for i in ok),
        float(rec["duration"]),
        len(rec["ttfts"]),
        len(errors),
    )
    metrics["per_request"] = per_request(  # bench_serving's order; it reports no per-request latency
        [
            Result(
                key=f"gsp/{i}",
                prompt_tokens=rec["input_lens"][i],
                cached_tokens=rec["cached_tokens"][i],
                ttft_s=rec["ttfts"][i],
                error=rec.get("errors", [""] * len(rec["ttfts"]))[i] or None,
            )
            for i in range(len(rec["ttfts"]))
        ]
    )
    metrics["bench_serving"] = {
        k: rec.get(k)
        for k in (
            "median_ttft_ms",
            "p90_ttft_ms",
            "output_throughput",
            "total_input_tokens",
            "duration",
            "cache_report",
        )
    }
    if verbose:
        print(
            f"  [{label}] bench_serving done in {time.time() - t0:.0f}s: hit rate "
            f"{_fmt(metrics['hit_rate'])}, TTFT p50 {_fmt(metrics['ttft_p50_s'])}s",
            flush=True,
        )
    # generated text, not ids: bench_serving returns text only (informational comparison)
    outputs = {f"gsp/{i}": rec["generated_texts"][i] for i in ok}
    return metrics, outputs


def bench_serving_runs() -> bool:
    """Whether SGLang's ``bench_serving`` can be imported here: it imports every dataset module,
    and one of them (``mmmu``) needs Hugging Face ``datasets``, which the GPU wheel set lacks."""
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def run_gsp_native(
    url: str,
    label: str,
    vocab: list[int],
    *,
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    concurrency: int,
    seed: int,
    verbose: bool = True,
) -> tuple[dict, dict]:
    """The generated-shared-prefix workload through this project's own client, for where
    ``bench_serving`` does not run (:func:`bench_serving_runs`): ``groups`` random system prompts
    of ``system_len`` tokens, each followed by ``prompts_per_group`` random questions of
    ``question_len`` tokens; every request asks ``output_len`` greedy tokens, sent in a seeded
    random order (``bench_serving`` shuffles its requests too), ``concurrency`` at a time, against
    a flushed cache. Token ids are drawn from ``vocab``, not from text, so the prompt lengths are
    exact. TTFT is the client's (request sent -> first streamed token), as for the other
    workloads; outputs are greedy token ids."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = [rng.choice(vocab) for _ in range(system_len)]
        for q in range(prompts_per_group):
            prompts.append((f"gsp/{g}/{q}", system + [rng.choice(vocab) for _ in range(question_len)]))
    rng.shuffle(prompts)
    results: list = [None] * len(prompts)
    progress = Progress(f"{label} gsp", len(prompts), verbose)

    def one(i: int) -> Result:
        key, ids = prompts[i]
        res = generate_stream(url, key, ids, output_len)
        results[i] = res
        progress.step(res)
        return res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(len(prompts))))
    duration = time.perf_counter() - t0
    return summarize_results(results, duration), {r.key: r.output_ids for r in results if r.error is None}


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# ----------------------------------------------------------------------------- multi-turn
def add_multiturn_args(p, *, conversations: int, turns: int, first_len: int, user_len: int, reply_len: int) -> None:
    """The flags of :func:`run_multiturn`'s workload, with a benchmark's own defaults."""
    p.add_argument("--conversations", type=int, default=conversations, help="chats at once (= requests in flight)")
    p.add_argument("--turns", type=int, default=turns, help="turns per chat")
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--first-len", type=int, default=first_len, help="user tokens of the first turn")
    p.add_argument("--user-len", type=int, default=user_len, help="user tokens of each later turn")
    p.add_argument("--reply-len", type=int, default=reply_len, help="greedy output tokens per turn")
    p.add_argument("--seed", type=int, default=0, help="workload seed (recorded)")


def check_multiturn_args(p, args) -> None:
    """``p.error`` for workload flags :func:`run_multiturn` cannot run."""
    for name in ("conversations", "turns", "reply_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_len + args.first_len < 1 or args.user_len < 0:
        p.error("--system-len + --first-len must be >= 1 and --user-len >= 0")


def multiturn_kwargs(args) -> dict:
    """:func:`run_multiturn`'s workload keywords from flags added by :func:`add_multiturn_args`."""
    names = ("conversations", "turns", "system_len", "first_len", "user_len", "reply_len", "seed")
    return {n: getattr(args, n) for n in names}


def run_multiturn(
    url: str,
    label: str,
    vocab: list[int],
    *,
    conversations: int,
    turns: int,
    system_len: int,
    first_len: int,
    user_len: int,
    reply_len: int,
    seed: int,
    verbose: bool = True,
    session_header: Optional[str] = None,
    branches: int = 1,
    fork_at: int = 0,
    system_prompts: int = 1,
    interleaved: bool = False,
) -> tuple[dict, dict]:
    """``conversations`` concurrent chats of ``turns`` turns. Chat ``c`` starts from system prompt
    ``c % system_prompts`` (``system_len`` tokens each); turn 0 adds ``first_len`` user tokens; every
    later turn's prompt is the previous prompt + the previous reply (the server's own greedy output
    ids) + ``user_len`` new user tokens.
    With ``branches`` > 1 each chat forks at turn ``fork_at``: from there on, ``branches``
    continuations of the same history (each with its own user messages; a user editing a message,
    or regenerating from it) run one after another, each for the remaining turns (keys
    ``conv<c>/b<k>/turn<t>``). So a later branch's first turn restores from the end of the answer
    before the fork, which the first branch's turns went past.
    ``interleaved``: one request at a time instead, the chats taking turns (every chat's next
    request, in chat order, then again), so each chat's next turn comes after all the others'.
    ``session_header``: send each chat's id (``conv<c>``) in this header (a router's session key)."""
    rng = random.Random(seed)
    # the first system prompt is drawn first, so one system prompt gives the same tokens as before
    systems = [[rng.choice(vocab) for _ in range(system_len)] for _ in range(system_prompts)]
    forked = branches > 1
    users = []
    for c in range(conversations):
        r = random.Random(seed * 7919 + c + 1)
        shared = [[r.choice(vocab) for _ in range(first_len if t == 0 else user_len)] for t in range(turns)]
        per_branch = [shared]
        for _ in range(1, branches):  # the same history up to the fork, new messages from it on
            per_branch.append(
                shared[:fork_at]
                + [[r.choice(vocab) for _ in range(first_len if t == 0 else user_len)] for t in range(fork_at, turns)]
            )
        users.append(per_branch)
    total = conversations * (turns + (branches - 1) * (turns - fork_at))
    progress = Progress(f"{label} multi-turn", total, verbose)
    results: list[Result] = []
    lock = threading.Lock()

    def steps(c: int):
        """Chat ``c``'s requests in order: yields (key, prompt), is sent that request's output ids."""
        prompt: list[int] = list(systems[c % system_prompts])
        at_fork: list[int] = []
        for b in range(branches):
            if b:
                prompt = list(at_fork)
            for t in range(fork_at if b else 0, turns):
                if t == fork_at and b == 0:
                    at_fork = list(prompt)
                prompt = prompt + users[c][b][t]
                out = yield (f"conv{c}/b{b}/turn{t}" if forked else f"conv{c}/turn{t}"), prompt
                prompt = prompt + out

    def send(c: int, key: str, prompt: list) -> Result:
        headers = {session_header: f"conv{c}"} if session_header else None
        res = generate_stream(url, key, prompt, reply_len, headers=headers)
        with lock:
            results.append(res)
        progress.step(res)
        return res

    def advance(gen, res: Result):
        """The chat's next (key, prompt) after ``res``; None when it is done or ``res`` failed (its
        later turns would need this reply)."""
        if res.error:
            return None
        try:
            return gen.send(res.output_ids)
        except StopIteration:
            return None

    def chat(c: int) -> None:
        gen = steps(c)
        step = next(gen)
        while step is not None:
            step = advance(gen, send(c, *step))

    def take_turns() -> None:
        gens = {c: steps(c) for c in range(conversations)}
        pending = {c: next(g) for c, g in gens.items()}
        while pending:
            for c in sorted(pending):
                step = advance(gens[c], send(c, *pending[c]))
                if step is None:
                    del pending[c]
                else:
                    pending[c] = step

    t0 = time.perf_counter()
    if interleaved:
        take_turns()
    else:
        ex = ThreadPoolExecutor(conversations)
        try:
            list(ex.map(chat, range(conversations)))
        finally:
            # On Ctrl-C do not wait here for chats still in a request: the caller's cleanup (stopping
            # the servers) must run first, and it is what ends those requests.
            ex.shutdown(wait=False, cancel_futures=True)
    duration = time.perf_counter() - t0
    return summarize_results(results, duration), {r.key: r.output_ids for r in results if r.error is None}


# ----------------------------------------------------------------------------- trace slice
@dataclass
class TraceSlice:
    """A scaled slice of a Mooncake trace as per-token symbols (``to_symbolic(unit=1)``)."""

    description: dict
    prompts: list = field(default_factory=list)  # per request: list of per-token symbols
    max_new_tokens: list = field(default_factory=list)
    out_len: list = field(default_factory=list)  # trace output tokens the next turn sees
    parent: list = field(default_factory=list)
    out_atom: dict = field(default_factory=dict)  # symbol of (request i output, position j) -> (i, j)

    def __len__(self) -> int:
        return len(self.prompts)


def build_trace_slice(
    path: str, *, requests_n: int, window: int, scale: int, max_output: int, max_context: Optional[int] = None
) -> TraceSlice:
    """Take a slice of a Mooncake trace and scale it to fit a CPU, reusing
    ``benchmarks.trace.mooncake`` (``load_trace`` + ``to_symbolic``) for the hash-id -> token rules.

    Scaling: every input length is divided by ``scale`` (rounded up), the 512-token hash block
    becomes ``512 / scale`` tokens (so the hash-id structure is unchanged), and output lengths are
    divided by ``scale`` (rounded down) and capped at ``max_output``. Rounding this way keeps
    ``L_parent + O_parent <= L_child`` true, so conversation turns link exactly as unscaled.

    Slice: among the first ``window`` requests (timestamp order) the multi-turn conversations
    (a request plus its later turns) are taken in order of their first turn until ``requests_n``
    requests are chosen. The first few hundred requests of the shipped trace are all first turns
    (second turns arrive ~2 min later), so "the first N requests" would test nothing but the shared
    system-prompt block. With ``max_context``, a conversation with a turn whose scaled prompt plus
    output exceeds it is not taken: the server would refuse that turn (and its output ids are no
    answer), so it would measure nothing."""
    if scale < 1 or BLOCK % scale:
        raise ValueError(f"--trace-scale must divide {BLOCK}, got {scale}")
    block = BLOCK // scale
    reqs = sorted(load_trace(path, limit=window), key=lambda r: r.timestamp)

    def scaled(r: TraceRequest) -> TraceRequest:
        return TraceRequest(
            r.line, r.timestamp, -(-r.input_length // scale), min(max_output, r.output_length // scale), r.hash_ids
        )

    win = [scaled(r) for r in reqs]
    st = to_symbolic(win, unit=block, block=block)
    root = list(range(len(win)))
    members: dict[int, list] = {}
    for i, p in enumerate(st.parent):
        root[i] = root[p] if p >= 0 else i
        members.setdefault(root[i], []).append(i)
    chosen: list[int] = []
    convs = 0
    for rt in sorted(members):
        if len(members[rt]) < 2 or len(chosen) >= requests_n:
            continue
        if max_context is not None and any(
            win[i].input_length + max(1, win[i].output_length) > max_context
            for i in members[rt][: requests_n - len(chosen)]
        ):
            continue
        chosen.extend(members[rt][: requests_n - len(chosen)])
        convs += 1
    if not chosen:
        raise ValueError(
            f"no multi-turn conversation among the first {window} requests of {path}; raise --trace-window"
        )
    chosen.sort()
    sub = [win[i] for i in chosen]
    sym = to_symbolic(sub, unit=1, block=block)
    ts = TraceSlice(
        description={
            "trace": os.path.abspath(path),
            "window": window,
            "requests": len(sub),
            "conversations": convs,
            "trace_lines": [r.line for r in sub],
            "scale": scale,
            "block_tokens": block,
            "max_output": max_output,
            "max_context": max_context,
            "rule": (
                f"input lengths / {scale} (ceil), 512-token hash blocks -> {block} tokens, output lengths / "
                f"{scale} (floor) capped at {max_output}; multi-turn conversations among the first {window} "
                f"requests, in order, until {requests_n} requests; dispatched in trace order, closed loop "
                f"(trace timestamps ignored), a turn waits for its previous turn"
                + ("" if max_context is None else f"; conversations with a turn over {max_context} tokens skipped")
            ),
            "unscaled_prompt_tokens": sum(reqs[i].input_length for i in chosen),
        }
    )
    for i, r in enumerate(sub):
        ts.prompts.append(sym.seq[i][: r.input_length].tolist())
        ts.out_len.append(r.output_length)
        ts.max_new_tokens.append(max(1, r.output_length))
        ts.parent.append(sym.parent[i])
        for j in range(r.output_length):
            # the symbol to_symbolic gives output atom (request i, position j): hash((2i+1, j, 1))
            ts.out_atom[hash((2 * i + 1, j, 1))] = (i, j)
    # sanity: a turn starts with its parent's prompt, token for token
    for i, p in enumerate(ts.parent):
        if p >= 0:
            lp = len(ts.prompts[p])
            assert ts.prompts[i][:lp] == ts.prompts[p], f"turn {i} does not extend its parent {p}"
    return ts


def run_trace(
    url: str, label: str, ts: TraceSlice, vocab: list[int], *, concurrency: int, verbose: bool = True
) -> tuple[dict, dict]:
    """Replay a :class:`TraceSlice` with real token ids: a hash-block token becomes
    ``vocab[symbol % len(vocab)]``; a token that is an earlier request's output becomes that
    request's actual greedy output token from this server (so a next turn sees the real reply)."""
    n = len(ts)
    done = [threading.Event() for _ in range(n)]
    results: list = [None] * n
    progress = Progress(f"{label} trace", n, verbose)

    def one(i: int) -> Result:
        deps = {ts.out_atom[s][0] for s in ts.prompts[i] if s in ts.out_atom}
        for d in deps:
            done[d].wait()
        key = f"trace/{i}"
        if any(results[d].error or len(results[d].output_ids) < ts.out_len[d] for d in deps):
            res = Result(key=key, error="an earlier turn failed")
        else:
            ids = []
            for s in ts.prompts[i]:
                a = ts.out_atom.get(s)
                ids.append(results[a[0]].output_ids[a[1]] if a is not None else vocab[s % len(vocab)])
            res = generate_stream(url, key, ids, ts.max_new_tokens[i])
        results[i] = res
        done[i].set()
        progress.step(res)
        return res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:  # FIFO: a request's earlier turns start before it
        list(ex.map(one, range(n)))
    duration = time.perf_counter() - t0
    return summarize_results(results, duration), {r.key: r.output_ids for r in results if r.error is None}
