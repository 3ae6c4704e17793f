"""CPU cost of one scheduling step's cache work as the tree grows: k3 beside SGLang's Python tree core.

What is measured
----------------
A *step* is the cache work the server does for one request in one scheduling step of a steady
state whose memory budget is FULL, so that eviction runs on (nearly) every step. Concurrency is
one: each step admits one request and finishes it. The request continues a cached conversation
(a new turn: its prompt is the last turn's prompt + answer + a new user message) or starts a new
conversation over one of a few shared system prompts, so every admission matches a prefix the
tree holds (or held until it was evicted).

* ``k3``: the cache the server ships, built by ``build_lifecycle`` from the default
  ``K3Config()`` with unified memory (one :class:`~sglang_k3.cache.block_ledger.BlockLedger`
  for MLA KV and int8 checkpoints, cut by ``plan_geometry``), driven by the trace replay's own
  driver :class:`benchmarks.policies.k3.K3Policy` (``admit`` then ``finish``: ``match(admit=True)``,
  KV allocation, ``insert``, ``export_plan`` / ``store_exports`` / ``checkpoint_running``,
  ``release_pin``, ``insert`` of prompt + answer, ``finish``, ``release``; every shortage evicts
  through :class:`~sglang_k3.cache.unified_eviction.UnifiedEviction`). Positions are tokens
  (``unit=1``, as in the server), byte sizes are a model preset's (``--model``).
* ``upstream``: SGLang 0.5.23's ``UnifiedRadixCache`` with FULL + MAMBA components and its pure
  Python tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``), on real SGLang pools on
  the CPU (``HybridReqToTokenPool``, ``HybridLinearKVPool``, ``TokenToKVPoolAllocator``, tiny
  per-token shapes). The step mirrors what its scheduler asks of the cache for one request
  (``no_buffer``, page 1): ``match_prefix``, lock the hit, a state slot for the request, KV for
  the prompt (``evict_from_tree_cache`` on a shortage), ``insert`` of the prompt with a forked
  state, the lock moved to the inserted node (``checkpoint_into_tree``'s steps), KV for the
  answer, ``insert`` of prompt + answer donating the request's state, unlock. It is driven
  through the cache's public methods, not through ``Req`` objects and the scheduler.

Each step is timed with ``time.perf_counter_ns`` around the cache calls only (the workload is
generated before the timer starts), and so are its parts: ``match``, ``insert``, ``evict`` (every
eviction the step's allocations trigger, wherever it runs), ``checkpoint`` (k3's checkpoint and
finish verbs, less the eviction inside them) and ``other`` (the rest: the driver's glue, locks,
allocator calls). Parts are exclusive times; they sum to the step.

Tree sizes: ``--sizes`` are the tokens the tree should hold while it is timed. The traffic is
run alone first (no cache) until its live conversations have turned over, so the cache fills
with steady-state traffic. k3's byte budget is calibrated at each size: rounds that replay the
measurement's own steps (same seed; the cache is deterministic), each scaling the budget by
``size / mean tokens held`` over the timed window (above ``--calibrate-max``: one round of 100
steps from the bytes per token found below, rescaled once). A full k3 tree's size moves from
step to step (a shortage frees whole ledger blocks; at the 48B preset one block holds one int8
checkpoint or ~1,500 KV tokens, so a 10^3-token tree is one KV block), and a large tree has
turned over less before it is timed (the mean, min and max tokens, the nodes, the checkpoints
and the turnovers are recorded for every size). Upstream's KV pool is that many tokens and its
state pool has one slot per ``--upstream-tokens-per-state`` tokens, so KV is what binds.

Noise: the timer is wall time, as asked of the benchmark; the thread's CPU time
(``time.thread_time_ns``) is recorded beside it, since other work sharing the cores preempts a
step and inflates wall-time tails. Python's garbage collector runs as in SGLang's scheduler
(on; ``--no-gc`` turns it off while timing) and its collections are counted.

Output: ``results.json`` (every number, the seeds, the config, the fits of p99 against log n and
against n, and a cProfile of the largest size) and ``step_cost.png`` (log-log p50 / p99 per step
against tree size, k3 and upstream side by side) in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import sys
import time
import traceback
from array import array
from collections import defaultdict
from typing import Callable, Optional

DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000)
DEFAULT_OUT = os.path.join("benchmarks", "results", "cache_step_cost")
PARTS_K3 = ("match", "insert", "checkpoint", "evict", "other")
PARTS_UP = ("match", "insert", "evict", "other")
TARGET_P99_MS = 1.0
TARGET_NODES = 100_000


# ---------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    system_prompts: int = 8  # shared system prompts new conversations start from
    system_len: int = 128  # tokens
    user_len: tuple = (8, 96)  # new user tokens per turn (uniform, inclusive)
    output_len: tuple = (8, 96)  # answer tokens per turn (uniform, inclusive)
    max_turns: int = 10  # a conversation ends after this many turns ...
    max_share: float = 0.5  # ... or once it holds this share of the tree (binds below ~2,500 tokens)
    p_new: float = 0.25  # a step starts a new conversation with this probability
    working_set: float = 2.0  # live conversations hold about this many times the tree's tokens

    def max_context(self) -> int:
        return self.system_len + self.max_turns * (self.user_len[1] + self.output_len[1]) + 64


@dataclasses.dataclass
class Request:
    prompt: list
    output: list
    new_conversation: bool


class Conversations:
    """Seeded multi-turn traffic. A step continues a live conversation picked uniformly (its
    prompt extends the previous turn's prompt + answer) or, with probability ``p_new``, starts a
    new one over a shared system prompt. Live conversations hold about ``working_set`` times the
    tree's tokens (the oldest retire first), so some continuations hit and some find their path
    evicted, in the same proportion at every tree size."""

    def __init__(self, size: int, seed: int, cfg: WorkloadConfig = WorkloadConfig()):
        self.cfg, self.size = cfg, size
        self.rng = random.Random(seed)
        self.systems = [self._tokens(cfg.system_len) for _ in range(cfg.system_prompts)]
        self.live: list[list] = []  # [tokens so far, turns]
        self.live_tokens = 0

    def _tokens(self, n: int) -> list:
        r = self.rng.randrange
        return [r(1, 1 << 30) for _ in range(n)]

    def next(self) -> Request:
        cfg, rng = self.cfg, self.rng
        new = not self.live or rng.random() < cfg.p_new
        if new:
            conv = [list(rng.choice(self.systems)), 0]
            self.live.append(conv)
            self.live_tokens += len(conv[0])
        else:
            conv = self.live[rng.randrange(len(self.live))]
        prompt = conv[0] + self._tokens(rng.randint(*cfg.user_len))
        output = self._tokens(rng.randint(*cfg.output_len))
        self.live_tokens += len(prompt) + len(output) - len(conv[0])
        conv[0], conv[1] = prompt + output, conv[1] + 1
        if conv[1] >= cfg.max_turns or len(conv[0]) + cfg.user_len[1] + cfg.output_len[1] > cfg.max_share * self.size:
            self._retire(conv)
        while self.live and self.live_tokens > cfg.working_set * self.size:
            self._retire(self.live[0])
        return Request(prompt, output, new)

    def prewarm(self) -> int:
        """Run the traffic alone (no cache) until the live set has turned over a few times, so
        the cache is filled by steady-state traffic, not by the first turns of fresh conversations.
        Returns the requests drawn."""
        cfg = self.cfg
        mean_turn = (sum(cfg.user_len) + sum(cfg.output_len)) / 2
        n = int(3 * cfg.working_set * self.size / mean_turn) + 50
        for _ in range(n):
            self.next()
        return n

    def _retire(self, conv) -> None:
        del self.live[next(i for i, c in enumerate(self.live) if c is conv)]  # by identity, not by content
        self.live_tokens -= len(conv[0])


# ---------------------------------------------------------------------------------- timing
class PartTimer:
    """Exclusive wall time per part: a timed call nested in another is charged to its own part
    and taken out of the enclosing one."""

    def __init__(self) -> None:
        self.acc: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[int] = []

    def wrap(self, part: str, fn: Callable) -> Callable:
        clock, stack, acc, calls = time.perf_counter_ns, self._stack, self.acc, self.calls

        def timed(*args, **kwargs):
            stack.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                inner = stack.pop()
                acc[part] += dt - inner
                calls[part] += 1
                if stack:
                    stack[-1] += dt

        return timed

    def take(self) -> dict[str, int]:
        out = dict(self.acc)
        self.acc.clear()
        return out


def _wrap_methods(timer: PartTimer, obj, part: str, names) -> list[str]:
    """Replace ``obj.<name>`` by a timed wrapper for each name it has (instance attributes, so
    the object's own calls through ``self`` are timed too); returns the names wrapped."""
    done = []
    for name in names:
        fn = getattr(obj, name, None)
        if callable(fn):
            setattr(obj, name, timer.wrap(part, fn))
            done.append(name)
    return done


def _quantile(sorted_xs: list, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_xs:
        return float("nan")
    pos = q * (len(sorted_xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize_ns(samples_ns: list, rounds: int = 3) -> dict:
    """Quantiles in ms; also the p99 of each of ``rounds`` consecutive slices of the run and
    their median (how stable the tail is while other work shares the cores)."""
    xs = sorted(samples_ns)
    ms = 1e-6
    k = max(1, len(samples_ns) // rounds)
    slices = [samples_ns[i * k : (i + 1) * k if i < rounds - 1 else None] for i in range(rounds)]
    per_round = [_quantile(sorted(sl), 0.99) * ms for sl in slices if sl]
    return {
        "n": len(xs),
        "mean_ms": (sum(xs) / len(xs)) * ms if xs else float("nan"),
        "p50_ms": _quantile(xs, 0.50) * ms,
        "p90_ms": _quantile(xs, 0.90) * ms,
        "p99_ms": _quantile(xs, 0.99) * ms,
        "max_ms": xs[-1] * ms if xs else float("nan"),
        "p99_rounds_ms": per_round,
        "p99_median_of_rounds_ms": sorted(per_round)[len(per_round) // 2] if per_round else float("nan"),
    }


def _count_nodes(root) -> int:
    """Nodes under ``root`` (both trees keep ``children`` dicts), for the size record only."""
    n, stack = 0, list(root.children.values())
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------- k3
class _OneRequestTrace:
    """The slice of the replay's trace interface ``K3Policy`` reads, holding only the request
    being stepped (positions are tokens: ``unit=1``)."""

    def __init__(self) -> None:
        self.input_len: dict[int, int] = {}
        self.output_len: dict[int, int] = {}
        self._prompt: dict[int, list] = {}
        self._full: dict[int, list] = {}

    def put(self, i: int, req: Request) -> None:
        self.input_len[i], self.output_len[i] = len(req.prompt), len(req.output)
        self._prompt[i], self._full[i] = req.prompt, req.prompt + req.output

    def drop(self, i: int) -> None:
        for d in (self.input_len, self.output_len, self._prompt, self._full):
            d.pop(i, None)

    def prompt(self, i: int) -> list:
        return self._prompt[i]

    def full(self, i: int) -> list:
        return self._full[i]


class K3Bench:
    name = "k3"
    parts = PARTS_K3

    def __init__(self, model: str, budget_bytes: int):
        from benchmarks.policies.base import SimConfig
        from benchmarks.policies.k3 import K3Policy
        from sglang_k3.cache import cost_model

        self.sim = SimConfig(cost=cost_model.preset(model), unit=1, checkpoint_dtype="int8")
        self.policy = K3Policy(self.sim, budget_bytes)
        self.lc = self.policy.lifecycle
        self.tree = self.lc.tree
        self.trace = _OneRequestTrace()
        self.timer = PartTimer()
        self.budget_bytes = budget_bytes
        self.wrapped = {
            "match": _wrap_methods(self.timer, self.lc, "match", ["match"]),
            "insert": _wrap_methods(self.timer, self.lc, "insert", ["insert"]),
            "checkpoint": _wrap_methods(
                self.timer,
                self.lc,
                "checkpoint",
                ["export_plan", "store_exports", "checkpoint_running", "finish", "release_pin", "release"],
            ),
            "evict": _wrap_methods(self.timer, self.lc, "evict", ["evict", "evict_until", "evict_handles"])
            + _wrap_methods(self.timer, self.policy.evictor, "evict", ["for_kv", "for_checkpoint", "for_active"]),
        }
        self._i = 0
        self.hits = 0
        self.prompt_tokens = 0
        self.new_tokens = 0  # tokens computed (not restored) by all steps so far

    def reclaims(self) -> int:
        """Shortages met by evicting so far (the ledger counts them)."""
        return self.policy.ledger.counters.reclaims

    def counters(self) -> dict:
        """What eviction took so far, as the replay's driver reports it."""
        s = self.policy.summary()
        return {
            "shortages_met_by_evicting": self.reclaims(),
            "checkpoints_evicted": s["checkpoints_evicted"],
            "checkpoints_recycled": s["checkpoints_recycled"],
            "kv_tokens_evicted": s["kv_tokens_evicted"],
        }

    def step(self, req: Request) -> tuple[int, int, dict[str, int]]:
        i, self._i = self._i, self._i + 1
        self.trace.put(i, req)
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0 = cpu()
        t0 = clock()
        adm = self.policy.admit(self.trace, i)
        self.policy.finish(self.trace, i, adm.ctx)
        dt = clock() - t0
        dc = cpu() - c0
        self.trace.drop(i)
        self.hits += adm.hit_tokens
        self.prompt_tokens += len(req.prompt)
        self.new_tokens += len(req.prompt) + len(req.output) - 1 - adm.hit_tokens
        parts = self.timer.take()
        parts["other"] = dt - sum(parts.values())
        return dt, dc, parts

    def tokens(self) -> int:
        return self.tree.total_size()

    def checkpoints(self) -> int:
        return self.tree.checkpoint_count()

    def sizes(self) -> dict:
        return {"tokens": self.tokens(), "nodes": _count_nodes(self.tree.root), "checkpoints": self.checkpoints()}

    def describe(self) -> dict:
        g = self.policy.ledger.geom
        return {
            "k3_config": dataclasses.asdict(self.policy.k3),
            "model": self.sim.cost.name,
            "unit_tokens": self.sim.unit,
            "budget_bytes": self.budget_bytes,
            "kv_bytes_per_token": self.sim.kv_bytes_per_symbol,
            "checkpoint_bytes": self.policy.store.slot_bytes,
            "ledger": {
                "num_blocks": g.num_blocks,
                "block_bytes": g.block_bytes,
                "kv_tokens_per_block": g.kv_per_block,
                "checkpoints_per_block": g.ckpt_per_block,
                "active_span": g.active_span,
            },
            "timed_methods": self.wrapped,
        }


def k3_budget_floor(model: str) -> int:
    """The smallest budget the ledger accepts (the padding target, one state slot and one KV
    block) plus one block."""
    from benchmarks.policies.base import SimConfig
    from sglang_k3.cache import block_ledger, cost_model

    sim = SimConfig(cost=cost_model.preset(model), unit=1, checkpoint_dtype="int8")
    geom = block_ledger.plan_geometry(
        1 << 40,
        kv_token_bytes=sim.kv_bytes_per_symbol,
        active_bytes=sim.checkpoint_bytes("fp32"),
        ckpt_bytes=sim.checkpoint_bytes("int8"),
    )
    return (2 * geom.active_span + 2) * geom.block_bytes


def calibrate_k3_budget(
    size: int,
    model: str,
    seed: int,
    wl: WorkloadConfig,
    start: int,
    rounds: int,
    window: int,
    log=_say,
    verify_last: bool = True,
) -> tuple[int, list]:
    """A byte budget under which the k3 tree holds about ``size`` tokens while it is timed: from
    ``start`` bytes, fill the tree with the measurement's own workload (same seed: the cache is
    deterministic, so a round replays the measurement's first steps), take the mean tokens held
    over the ``window`` steps after the budget first fills, scale the budget by
    ``size / held``; at most ``rounds`` times, stopping within 5 %. Returns the tried budget
    closest to ``size`` (without ``verify_last``: the last round's rescaled budget, untried) and
    every round's numbers."""
    floor = k3_budget_floor(model)
    budget = max(floor, start)
    history = []
    for _ in range(rounds):
        bench = K3Bench(model, budget)
        conv = Conversations(size, seed, wl)
        conv.prewarm()
        held = _fill(bench, conv, size, extra=window, log=None)
        history.append({"budget_bytes": budget, "mean_tokens_held": held, "window_steps": window})
        if log:
            log(f"  calibrate k3 @ {size:,}: budget {budget / 2**20:,.1f} MiB -> tree holds {held:,.0f} tokens")
        del bench, conv
        if abs(held - size) <= 0.05 * size:
            return budget, history
        budget = max(floor, int(budget * size / held)) if held > 0 else 2 * budget
    if not verify_last:
        history.append({"budget_bytes": budget, "untried": True})
        return budget, history
    return min(history, key=lambda h: abs(h["mean_tokens_held"] - size))["budget_bytes"], history


def _fill(bench, wl: Conversations, size: int, extra: int, log=_say, max_steps: Optional[int] = None) -> float:
    """Step until the budget is full (the first eviction), then ``extra`` steps more; returns
    the mean tokens the tree held over those (a full tree's size moves from step to step: a
    shortage frees whole ledger blocks, and KV and checkpoints trade blocks)."""
    steps = 0
    t0 = time.perf_counter()
    last = t0
    limit = max_steps if max_steps is not None else 40 * size + 10_000
    while bench.reclaims() == 0 and steps < limit:
        bench.step(wl.next())
        steps += 1
        if log and time.perf_counter() - last > 10:
            last = time.perf_counter()
            log(
                f"    {bench.name} @ {size:,}: filling, {steps:,} steps, tree holds "
                f"{bench.tokens():,} tokens ({last - t0:.0f} s)"
            )
    held = []
    for _ in range(extra):
        bench.step(wl.next())
        held.append(bench.tokens())
    return sum(held) / len(held) if held else float(bench.tokens())


# ---------------------------------------------------------------------------------- upstream
class UpstreamUnavailable(RuntimeError):
    pass


class UpstreamBench:
    """SGLang's ``UnifiedRadixCache`` (FULL + MAMBA, Python tree core) on small real CPU pools."""

    name = "upstream"
    parts = PARTS_UP

    def __init__(self, size: int, tokens_per_state: int, max_context: int):
        try:
            import torch
            from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape
            from sglang.srt.environ import envs
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.common import evict_from_tree_cache
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
            from sglang.srt.mem_cache.radix_cache import RadixKey
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
            from sglang.srt.runtime_context import create_context, use_context
            from sglang.srt.server_args import ServerArgs
        except Exception as e:  # pragma: no cover - depends on the install
            raise UpstreamUnavailable(f"importing SGLang's unified cache failed: {e!r}") from e
        self.torch = torch
        self.EvictParams, self.InsertParams, self.MatchPrefixParams = EvictParams, InsertParams, MatchPrefixParams
        self.RadixKey = RadixKey
        self._evict_from_tree_cache = evict_from_tree_cache
        # The cache reads SGLang's process config (mamba chunk size, exec flags); a scoped
        # context, entered around every call into the cache and never published.
        server_args = ServerArgs(model_path="dummy", page_size=1, device="cpu")
        server_args._mamba_cache_chunk_size = 64  # the FLA chunk; a dummy model cannot supply it
        self.ctx = create_context(server_args, role="test")
        self._use_context = use_context
        self.mamba_slots = -(-size // tokens_per_state) + 8
        with self.context():
            shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=1, head_dim=8, conv_kernel_size=4)
            rtp = HybridReqToTokenPool(
                size=2,
                mamba_size=self.mamba_slots,
                mamba_spec_state_size=0,
                max_context_len=max_context,
                device="cpu",
                enable_memory_saver=False,
                cache_params=KimiLinearCacheParams(shape=shape, layers=[0]),
                mamba_layer_ids=[0],
                enable_mamba_extra_buffer=False,
                enable_overlap_schedule=False,
            )
            kv = HybridLinearKVPool(
                size=size,
                dtype=torch.bfloat16,
                page_size=1,
                head_num=1,
                head_dim=16,
                full_attention_layer_ids=[1],
                device="cpu",
                mamba_pool=rtp.mamba_pool,
                use_mla=True,
                kv_lora_rank=8,
                qk_rope_head_dim=8,
            )
            self.alloc = TokenToKVPoolAllocator(
                size=size, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
            )
            self.mamba_alloc = rtp.mamba_allocator
            params = CacheInitParams(
                disable=False,
                req_to_token_pool=rtp,
                token_to_kv_pool_allocator=self.alloc,
                page_size=1,
                tree_components=(ComponentType.FULL, ComponentType.MAMBA),
                enable_mamba_extra_buffer=False,
            )
            with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):
                self.cache = UnifiedRadixCache(params)
        self.backend = self.cache._tree_core_backend
        self.tree_core_class = type(self.cache.tree_core).__name__
        if self.backend != "python":
            raise UpstreamUnavailable(f"SGLang selected the {self.backend!r} tree core, not the Python one")
        self.size = size
        self.tokens_per_state = tokens_per_state
        self.timer = PartTimer()
        c = self.cache
        self._match = self.timer.wrap("match", c.match_prefix)
        self._insert = self.timer.wrap("insert", c.insert)
        self._evict_kv = self.timer.wrap("evict", self._evict_from_tree_cache)
        self._evict_for_alloc = self.timer.wrap("evict", c.evict_for_alloc)
        self._kv_shortages = self._state_shortages = self._kv_evicted = 0
        self.hits = 0
        self.prompt_tokens = 0
        self.new_tokens = 0

    @contextlib.contextmanager
    def context(self):
        with self._use_context(self.ctx):
            yield

    def reclaims(self) -> int:
        return self._kv_shortages + self._state_shortages

    def counters(self) -> dict:
        return {
            "kv_shortages": self._kv_shortages,
            "state_shortages": self._state_shortages,
            "kv_tokens_evicted": self._kv_evicted,
        }

    def _kv(self, n: int):
        """``n`` KV slots, evicting the shortfall first (``alloc_for_extend``'s order)."""
        if n <= 0:
            return self.torch.empty((0,), dtype=self.torch.int64)
        free = self.alloc.available_size()
        if free < n:
            self._kv_shortages += 1
            self._evict_kv(self.cache, n)
            self._kv_evicted += self.alloc.available_size() - free
        got = self.alloc.alloc(n)
        if got is None:
            raise RuntimeError(f"upstream: no room for {n} KV tokens after evicting")
        return got

    def _state_slot(self):
        """One mamba slot, evicting a state first when none is free (``_alloc_mamba_slot``)."""
        slot = self.mamba_alloc.alloc(1)
        if slot is None:
            self._state_shortages += 1
            self._evict_for_alloc(self.EvictParams(num_tokens=0, mamba_num=1))
            slot = self.mamba_alloc.alloc(1)
            if slot is None:
                raise RuntimeError("upstream: no mamba slot after evicting")
        return slot

    def step(self, req: Request) -> tuple[int, int, dict[str, int]]:
        torch, c = self.torch, self.cache
        L = len(req.prompt)
        end = L + len(req.output) - 1  # the last generated token is never fed back
        key = self.RadixKey(array("q", req.prompt))
        full_key = self.RadixKey(array("q", req.prompt + req.output[:-1]))
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        with self.context():
            c0 = cpu()
            t0 = clock()
            m = self._match(self.MatchPrefixParams(key=key))
            lock = c.lock(m.last_device_node)
            prefix_len = m.device_prefix_len
            prefix = c.path_device_indices(m.last_device_node)[:prefix_len]
            running = self._state_slot()  # the request's own state (donated at finish)
            row = torch.cat([prefix, self._kv(L - prefix_len)])
            fork = self._state_slot()  # the prompt-end state forked into the tree
            ins = self._insert(self.InsertParams(key=key, value=row, mamba_value=fork, prev_prefix_len=prefix_len))
            if ins.mamba_exist:
                self.mamba_alloc.free(fork)
            node = ins.last_device_node
            row = c.path_device_indices(node)
            c.unlock(lock)
            lock = c.lock(node)
            value = torch.cat([row[:L], self._kv(end - L)])
            ins = self._insert(self.InsertParams(key=full_key, value=value, mamba_value=running, prev_prefix_len=L))
            if ins.mamba_exist:
                self.mamba_alloc.free(running)
            c.unlock(lock)
            dt = clock() - t0
            dc = cpu() - c0
        self.hits += prefix_len
        self.prompt_tokens += L
        self.new_tokens += end - prefix_len
        parts = self.timer.take()
        parts["other"] = dt - sum(parts.values())
        return dt, dc, parts

    def tokens(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def checkpoints(self) -> int:
        return self.cache.mamba_evictable_size() + self.cache.mamba_protected_size()

    def sizes(self) -> dict:
        nodes = _count_nodes(self.cache.tree_core.root_node)
        return {"tokens": self.tokens(), "nodes": nodes, "checkpoints": self.checkpoints()}

    def describe(self) -> dict:
        return {
            "tree_core_backend": self.backend,
            "tree_core_class": self.tree_core_class,
            "env": "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python",
            "components": ["FULL", "MAMBA"],
            "kv_pool_tokens": self.size,
            "mamba_slots": self.mamba_slots,
            "tokens_per_state_slot": self.tokens_per_state,
            "mamba_strategy": "no_buffer (page 1), driven through match_prefix / insert / evict_for_alloc",
        }


# ---------------------------------------------------------------------------------- one size
def measure(bench, wl: Conversations, size: int, steps: int, warm: int, log=_say, no_gc: bool = False) -> dict:
    t0 = time.perf_counter()
    log(f"  {bench.name} @ {size:,} tokens: filling the tree (a large tree takes a while) ...")
    _fill(bench, wl, size, extra=warm, log=log)
    fill_s = time.perf_counter() - t0
    before = bench.sizes()
    turnovers = bench.new_tokens / max(1, before["tokens"])
    log(
        f"  {bench.name} @ {size:,}: full after {fill_s:.1f} s: {before['tokens']:,} tokens, "
        f"{before['nodes']:,} nodes, {before['checkpoints']:,} checkpoints, {turnovers:.1f} tree turnovers; "
        f"timing {steps:,} steps"
    )
    reqs = [wl.next() for _ in range(steps)]  # generated before the timed steps
    counters0 = bench.counters()
    gc.collect()
    if no_gc:
        gc.disable()
    gc0 = [s["collections"] for s in gc.get_stats()]
    totals, cpu, parts = [], [], defaultdict(list)
    held, ckpts = [], []
    evicting, hits0, prompt0 = 0, bench.hits, bench.prompt_tokens
    t1 = time.perf_counter()
    for req in reqs:
        r0 = bench.reclaims()
        dt, dc, p = bench.step(req)
        evicting += bench.reclaims() > r0
        totals.append(dt)
        cpu.append(dc)
        for k in bench.parts:
            parts[k].append(p.get(k, 0))
        held.append(bench.tokens())
        ckpts.append(bench.checkpoints())
    run_s = time.perf_counter() - t1
    gc1 = [s["collections"] for s in gc.get_stats()]
    if no_gc:
        gc.enable()
    counters1 = bench.counters()
    after = bench.sizes()
    out = {
        "size_target_tokens": size,
        "steps": steps,
        "warm_steps": warm,
        "fill_s": fill_s,
        "run_s": run_s,
        "tree_before": before,
        "tree_after": after,
        # tokens the steps computed before the timing began, in units of the tree's size: how many
        # times the traffic has turned the tree over (small trees many times, 10^6 tokens under once)
        "turnovers_before_timing": turnovers,
        # sampled after every timed step (outside the timer); nodes only before and after (a walk)
        "tree_tokens": sum(held) / len(held),
        "tree_tokens_min_max": [min(held), max(held)],
        "tree_nodes": (before["nodes"] + after["nodes"]) / 2,
        "tree_checkpoints": sum(ckpts) / len(ckpts),
        "steps_that_evicted": evicting,
        "evictions_while_timed": {k: counters1[k] - counters0.get(k, 0) for k in counters1},
        "token_hit_rate": (bench.hits - hits0) / max(1, bench.prompt_tokens - prompt0),
        "gc_collections_during_run": [b - a for a, b in zip(gc0, gc1)],  # generations 0, 1, 2
        "gc_enabled_while_timed": not no_gc,
        "step": summarize_ns(totals),
        "step_cpu": summarize_ns(cpu),
        "parts": {k: summarize_ns(v) for k, v in parts.items()},
        "parts_mean_share": {k: sum(v) / max(1, sum(totals)) for k, v in parts.items()},
    }
    s, c = out["step"], out["step_cpu"]
    log(
        f"  {bench.name} @ {size:,}: step p50 {s['p50_ms']:.3f} ms, p99 {s['p99_ms']:.3f} ms "
        f"(thread CPU time p50 {c['p50_ms']:.3f}, p99 {c['p99_ms']:.3f}); tree {out['tree_tokens']:,.0f} tokens, "
        f"{evicting}/{steps} steps evicted, {run_s:.1f} s"
    )
    return out


def profile_steps(bench, wl: Conversations, steps: int, top: int = 25) -> dict:
    """cProfile over ``steps`` more steps: the top functions by cumulative time."""
    reqs = [wl.next() for _ in range(steps)]
    prof = cProfile.Profile()
    prof.enable()
    for req in reqs:
        bench.step(req)
    prof.disable()
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((ct, tt, nc, f"{_short(file)}:{line}({func})"))
    rows.sort(reverse=True)
    return {
        "steps": steps,
        "note": "cProfile overhead inflates these; compare functions with each other, not with the timed runs",
        "top_cumulative": [
            {
                "function": f,
                "calls": nc,
                "cumtime_ms_per_step": ct * 1e3 / steps,
                "tottime_ms_per_step": tt * 1e3 / steps,
            }
            for ct, tt, nc, f in rows[:top]
        ],
        "top_tottime": [
            {"function": f, "calls": nc, "tottime_ms_per_step": tt * 1e3 / steps}
            for _, tt, nc, f in sorted(rows, key=lambda r: -r[1])[:top]
        ],
    }


def _short(path: str) -> str:
    for mark in ("site-packages" + os.sep, "sglang_k3" + os.sep, "benchmarks" + os.sep):
        i = path.rfind(mark)
        if i >= 0:
            return path[i + len(mark) if mark.startswith("site") else i :]
    return path


# ---------------------------------------------------------------------------------- fits
def _linfit(xs: list, ys: list) -> dict:
    n = len(xs)
    if n < 2:
        return {"a": float("nan"), "b": float("nan"), "r2": float("nan")}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else float("nan")
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot else float("nan")}


def scaling(rows: list, key: str = "p99_ms", summary: str = "step") -> dict:
    """p99 (ms) against the tree's actual tokens ``n``: least-squares fits ``a + b ln n`` and
    ``a + b n``, the log-log slope (``p99 ~ n^k``: k near 0 is log-like or flat, near 1 linear),
    and the check that p99 grows no faster than log n between the smallest size and each other."""
    pts = [(r["tree_tokens"], r[summary][key]) for r in rows if r["tree_tokens"] > 1]
    if len(pts) < 2:
        return {"points": len(pts)}
    ns, ys = [p[0] for p in pts], [p[1] for p in pts]
    fit_log = _linfit([math.log(n) for n in ns], ys)
    fit_lin = _linfit(ns, ys)
    loglog = _linfit([math.log(n) for n in ns], [math.log(y) for y in ys])
    n0, y0 = pts[0]
    growth = [
        {
            "n": n,
            "p99_ratio": y / y0,
            "log_ratio": math.log(n) / math.log(n0),
            "no_faster_than_log": y / y0 <= math.log(n) / math.log(n0),
        }
        for n, y in pts[1:]
    ]
    return {
        "metric": f"{summary}.{key}",
        "x": "tree tokens held (measured)",
        "fit_log": {"model": "p99_ms = a + b*ln(n)", **fit_log},
        "fit_linear": {"model": "p99_ms = a + b*n", **fit_lin},
        "loglog_slope": loglog["b"],
        "loglog_r2": loglog["r2"],
        "growth_vs_smallest": growth,
        "grows_no_faster_than_log_n": all(g["no_faster_than_log"] for g in growth),
    }


def at_nodes(rows: list, nodes: float = TARGET_NODES) -> dict:
    """p99 at ``nodes`` tree nodes: the measured size nearest it, and a log-log interpolation
    (extrapolation when no size reaches it) between the two nearest measured sizes."""
    pts = sorted((r["tree_nodes"], r["step"]["p99_ms"], r["size_target_tokens"]) for r in rows if r["tree_nodes"] > 0)
    if not pts:
        return {}
    nearest = min(pts, key=lambda p: abs(math.log(p[0] / nodes)))
    out = {"nodes": nodes, "nearest_size": {"nodes": nearest[0], "p99_ms": nearest[1], "size": nearest[2]}}
    if len(pts) >= 2:
        below = [p for p in pts if p[0] <= nodes]
        above = [p for p in pts if p[0] > nodes]
        if below and above:
            a, b = below[-1], above[0]
            kind = "interpolated"
        else:
            a, b = (pts[-2], pts[-1]) if not above else (pts[0], pts[1])
            kind = "extrapolated"
        k = math.log(b[1] / a[1]) / math.log(b[0] / a[0])
        est = a[1] * (nodes / a[0]) ** k
        out.update({"estimate_p99_ms": est, "estimate": kind, "meets_1ms": est <= TARGET_P99_MS})
    return out


# ---------------------------------------------------------------------------------- plot
def plot(results: dict, path: str) -> None:
    """Left: per-step p50 and p99 against the tokens the tree held, both systems (thin dotted:
    p99 of the thread's CPU time, which the other work on the cores does not inflate). Right:
    the step's parts (p50)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.4))
    styles = {"k3": ("tab:blue", "-"), "upstream": ("tab:orange", "--")}
    for name, rows in results["systems"].items():
        rows = [r for r in rows if "step" in r]
        if not rows:
            continue
        color, ls = styles.get(name, ("k", ":"))
        xs = [r["tree_tokens"] for r in rows]
        ax.plot(xs, [r["step"]["p50_ms"] for r in rows], ls, marker="o", color=color, label=f"{name} p50")
        ax.plot(xs, [r["step"]["p99_ms"] for r in rows], ls, marker="^", color=color, alpha=0.6, label=f"{name} p99")
        ax.plot(
            xs,
            [r["step_cpu"]["p99_ms"] for r in rows],
            ":",
            lw=1,
            color=color,
            alpha=0.7,
            label=f"{name} p99, thread CPU time",
        )
        for j, (part, mk) in enumerate(zip(("match", "insert", "checkpoint", "evict"), ("s", "D", "P", "v"))):
            if all(part in r["parts"] for r in rows):
                bx.plot(
                    xs,
                    [max(1e-4, r["parts"][part]["p50_ms"]) for r in rows],
                    ls,
                    marker=mk,
                    color=color,
                    alpha=0.4 + 0.2 * j,
                    label=f"{name} {part}",
                )
    for a in (ax, bx):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("tokens held by the tree (measured mean while timed)")
        a.grid(True, which="both", alpha=0.3)
        a.axhline(TARGET_P99_MS, color="gray", lw=0.8, ls=":")
    ax.set_ylabel("ms per scheduling step (wall, perf_counter_ns)")
    ax.set_title("One step's cache time (match + insert + checkpoints + evict), full budget")
    bx.set_ylabel("ms per step, p50 of the part (exclusive)")
    bx.set_title("Parts of the step (p50)")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"cache step cost: seed {results['seed']}, {results['steps']} timed steps per size and system "
        f"(gray dotted: the 1 ms target)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict) -> list:
    """One line per size and system: the numbers the notes quote."""
    out = []
    for name, rows in results["systems"].items():
        for r in rows:
            line = {
                "system": name,
                "size": r["size_target_tokens"],
                "tokens": round(r["tree_tokens"]),
                "nodes": round(r["tree_nodes"]),
                "checkpoints": round(r["tree_checkpoints"]),
                "step_p50_ms": r["step"]["p50_ms"],
                "step_p99_ms": r["step"]["p99_ms"],
                "step_cpu_p99_ms": r["step_cpu"]["p99_ms"],
            }
            for part, p in r["parts"].items():
                line[f"{part}_p50_ms"] = p["p50_ms"]
                line[f"{part}_p99_ms"] = p["p99_ms"]
            out.append(line)
    return out


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cache_step_cost",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="comma-separated tree sizes, in tokens the steady-state tree holds (default: %(default)s)",
    )
    ap.add_argument("--steps", type=int, default=500, help="timed steps per size and system (default: %(default)s)")
    ap.add_argument(
        "--warm", type=int, default=100, help="steps after the budget first fills, untimed (default: %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument(
        "--model",
        default="kimi-linear-48b",
        help="cost-model preset for k3's byte sizes and eviction prices (default: %(default)s)",
    )
    ap.add_argument(
        "--systems", default="k3,upstream", help="which to measure: k3, upstream or both (default: %(default)s)"
    )
    ap.add_argument(
        "--upstream-tokens-per-state",
        type=int,
        default=32,
        help="upstream's state pool: one mamba slot per this many KV tokens (default: %(default)s)",
    )
    ap.add_argument(
        "--calibration-rounds",
        type=int,
        default=3,
        help="at most this many rounds sizing k3's byte budget at sizes up to --calibrate-max (default: %(default)s)",
    )
    ap.add_argument(
        "--calibration-window",
        type=int,
        default=0,
        help="steps after the first fill over which a calibration round averages the tree's tokens "
        "(default 0: --warm + --steps, the timed window; 100 above --calibrate-max)",
    )
    ap.add_argument(
        "--no-gc",
        action="store_true",
        help="disable Python's cyclic garbage collector during the timed steps (default: on, as SGLang's "
        "scheduler runs unless its freeze_gc API is called)",
    )
    ap.add_argument(
        "--calibrate-max",
        type=int,
        default=100_000,
        help="larger sizes start from the bytes per token calibrated below and check it in one round "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=60,
        help="cProfile this many extra steps at the largest size, per system (0: off; default: %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError:
        ap.error("--sizes must be comma-separated integers")
    if not args.sizes or min(args.sizes) < 1000:
        ap.error("--sizes must be integers >= 1000 (a smaller tree holds less than a few requests: no steady state)")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not set(args.systems) <= {"k3", "upstream"} or not args.systems:
        ap.error("--systems takes k3 and/or upstream")
    if args.steps < 2 or args.warm < 0:
        ap.error("--steps must be >= 2 and --warm >= 0")
    return args


def _k3_at(size: int, args, wl_cfg: WorkloadConfig, state: dict, log) -> dict:
    """One size of k3: size the budget, measure, profile at the largest size."""
    log(f"k3 @ {size:,} tokens")
    if size <= args.calibrate_max or "bytes_per_token" not in state:
        start = state.get("bytes_per_token", 0) * size or size * 8064 * 3
        window = args.calibration_window or args.warm + args.steps  # the window the run is timed over
        budget, hist = calibrate_k3_budget(
            size, args.model, args.seed, wl_cfg, int(start), args.calibration_rounds, window, log
        )
    else:  # one round from the calibrated bytes per token, rescaled once untried (a round at 10^6 costs ~30 s)
        budget, hist = calibrate_k3_budget(
            size,
            args.model,
            args.seed,
            wl_cfg,
            int(state["bytes_per_token"] * size),
            1,
            args.calibration_window or 100,
            log,
            verify_last=False,
        )
    state["bytes_per_token"] = budget / size
    bench = K3Bench(args.model, budget)
    wl = Conversations(size, args.seed, wl_cfg)
    wl.prewarm()
    row = measure(bench, wl, size, args.steps, args.warm, log, args.no_gc)
    row["budget_bytes"] = budget
    row["calibration"] = hist
    state["config"] = bench.describe()
    row["ledger"] = state["config"]["ledger"]
    row["kv_alloc_failures"] = bench.policy.kv_alloc_failures
    if size == max(args.sizes) and args.profile_steps:
        log(f"  k3 @ {size:,}: cProfile over {args.profile_steps} steps")
        row["profile"] = profile_steps(bench, wl, args.profile_steps)
    return row


def _upstream_at(size: int, args, wl_cfg: WorkloadConfig, state: dict, log) -> dict:
    log(f"upstream @ {size:,} tokens")
    bench = UpstreamBench(size, args.upstream_tokens_per_state, wl_cfg.max_context())
    wl = Conversations(size, args.seed, wl_cfg)
    wl.prewarm()
    row = measure(bench, wl, size, args.steps, args.warm, log, args.no_gc)
    state["config"] = bench.describe()
    row["mamba_slots"] = bench.mamba_slots
    if size == max(args.sizes) and args.profile_steps:
        log(f"  upstream @ {size:,}: cProfile over {args.profile_steps} steps")
        with bench.context():
            row["profile"] = profile_steps(bench, wl, args.profile_steps)
    return row


def _git_state() -> dict:
    """The commit the numbers were measured at, and the cache code changed since (if any)."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {
            "head": git("rev-parse", "HEAD"),
            "changed_since_head": git("status", "--porcelain", "--", "sglang_k3", "benchmarks/policies").splitlines(),
        }
    except Exception as e:  # no git: the numbers stand without it
        return {"error": repr(e)}


def run(args: argparse.Namespace, log=_say) -> dict:
    """Measure every size (k3 then upstream at each size, so both see the same background
    load at about the same time) and return the results document."""
    wl_cfg = WorkloadConfig()
    results: dict = {
        "benchmark": "cache_step_cost",
        "what": (
            "CPU time of one scheduling step's cache work (admission match, KV allocation with the "
            "eviction it triggers, inserts, checkpoints, finish, release) for one request, in a steady "
            "state with a full budget, against the tokens the tree holds"
        ),
        "seed": args.seed,
        "seeds": {"workload": args.seed, "k3_calibration": args.seed},
        "steps": args.steps,
        "warm_steps": args.warm,
        "sizes": sorted(args.sizes),
        "systems_asked": args.systems,
        "workload": dataclasses.asdict(wl_cfg),
        "timer": "time.perf_counter_ns around the cache calls (wall); step_cpu: time.thread_time_ns",
        "gc_enabled_while_timed": not args.no_gc,
        "targets": {
            "p99_grows_no_faster_than": "log n",
            "p99_ms_at_most": TARGET_P99_MS,
            "at_nodes": TARGET_NODES,
        },
        "run": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "argv": list(sys.argv[1:]),
            "git": _git_state(),
        },
        "systems": {name: [] for name in args.systems},
        "config": {},
    }
    if "upstream" in args.systems:
        results["upstream_status"] = {"available": True}
    t_all = time.perf_counter()
    states: dict = {name: {} for name in args.systems}
    for size in sorted(args.sizes):
        if "k3" in args.systems:
            results["systems"]["k3"].append(_k3_at(size, args, wl_cfg, states["k3"], log))
            gc.collect()
        if "upstream" in args.systems and results["upstream_status"]["available"]:
            try:
                results["systems"]["upstream"].append(_upstream_at(size, args, wl_cfg, states["upstream"], log))
            except Exception as e:
                results["upstream_status"] = {
                    "available": False,
                    "failed_at_size": size,
                    "reason": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=8),
                }
                log(f"upstream: not measured from {size:,} tokens on: {e!r}")
            gc.collect()
    for name, st in states.items():
        if "config" in st:
            results["config"][name] = st["config"]
    measured = {name: rows for name, rows in results["systems"].items() if rows}
    results["scaling"] = {name: scaling(rows) for name, rows in measured.items()}
    results["scaling_p50"] = {name: scaling(rows, "p50_ms") for name, rows in measured.items()}
    results["scaling_cpu_p99"] = {name: scaling(rows, "p99_ms", "step_cpu") for name, rows in measured.items()}
    results["at_100k_nodes"] = {name: at_nodes(rows) for name, rows in measured.items()}
    results["at_100k_tokens"] = {
        name: next(
            (
                {"size": r["size_target_tokens"], "p99_ms": r["step"]["p99_ms"], "meets_1ms": r["step"]["p99_ms"] <= 1}
                for r in rows
                if r["size_target_tokens"] == 100_000
            ),
            None,
        )
        for name, rows in measured.items()
    }
    results["table"] = table(results)
    results["run"]["wall_s"] = time.perf_counter() - t_all
    results["run"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    _say(
        f"cache_step_cost: sizes {args.sizes}, {args.steps} timed steps each, seed {args.seed}, "
        f"systems {args.systems}; large trees take a while to fill (10^6 tokens: minutes)"
    )
    results = run(args)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    plot(results, os.path.join(args.out, "step_cost.png"))
    _say(f"wrote {path} and step_cost.png ({results['run']['wall_s']:.0f} s)")
    for name, rows in results["systems"].items():
        for r in rows:
            s = r["step"]
            _say(
                f"  {name:9s} {r['size_target_tokens']:>9,} target  {r['tree_tokens']:>11,.0f} tokens "
                f"{r['tree_nodes']:>8,.0f} nodes  p50 {s['p50_ms']:8.3f} ms  p99 {s['p99_ms']:8.3f} ms"
            )
    return results


if __name__ == "__main__":
    main()
