"""The k3 cache in simulated memory: the server's own lifecycle, with handles and KV indices as ints.

:class:`SimulatedCache` drives :class:`~sglang_k3.cache.lifecycle.CacheLifecycle` (built by
:func:`~sglang_k3.cache.build.build_lifecycle` from a :class:`~sglang_k3.config.K3Config`, as the
server's cache is) through the verbs the server calls, in the server's order:

* prefill start: ``match(admit=True)`` (branch point, pin); the copy-on-write lands at the first
  forward: ``release_pin``;
* each prefill chunk end: ``insert``, then ``store_exports`` of the chunk-boundary states the
  extend exported (planned by ``export_plan`` when the forward began), then
  ``checkpoint_running`` (CHUNK, or PROMPT_END at the prompt end);
* finish: decode-interval checkpoints (``checkpoint_running`` DECODE), ``insert`` of prompt +
  output, ``finish`` (generation end, donated), ``release``.

Memory is what the server holds by default (unified memory): one
:class:`~sglang_k3.cache.block_ledger.BlockLedger` cut by the server's ``plan_geometry``, so block
packing and fragmentation are modelled; with ``unified_memory`` off, a checkpoint pool of
``checkpoint_slots`` of its own and KV in the rest of the budget. Positions are symbols of
``unit`` tokens each (the cost model answers in real FLOPs and bytes through :class:`ScaledCost`).

Two hosts: the trace replay's ``k3`` policy (``benchmarks/policies/k3.py``), and the miniature
caches with which the server chooses eviction's order while it runs
(:mod:`sglang_k3.cache.order_chooser`). Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional, Sequence

from sglang_k3.cache.block_ledger import BlockLedger, plan_geometry
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.cost_model import ModelCostConfig
from sglang_k3.cache.node import CheckpointKind
from sglang_k3.cache.order_chooser import OrderChooser, miniature_factory
from sglang_k3.cache.ports import TierPort
from sglang_k3.cache.ranking import EvictionPolicy
from sglang_k3.cache.unified_eviction import UnifiedEviction
from sglang_k3.config import K3Config


class ScaledCost:
    """A ``ModelCostConfig`` seen in symbols: the tree's eviction asks for FLOPs between symbol
    positions and for KV bytes per symbol; this answers in real FLOPs and bytes."""

    def __init__(self, cost: ModelCostConfig, unit: int) -> None:
        self.cost, self.unit = cost, unit
        # prefill_flops(a, b) = n * lin + att * (a + b + 1) * n / 2 with n = b - a (cost_model.py);
        # read both coefficients off the model once instead of rebuilding them on every call
        f1, f2 = cost.prefill_flops(0, 1), cost.prefill_flops(0, 2)
        self._att = f2 - 2 * f1
        self._lin = f1 - self._att
        assert abs(self._flops(1000, 4096) - cost.prefill_flops(1000, 4096)) <= 1e-9 * cost.prefill_flops(1000, 4096)

    def _flops(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        n = b - a
        return n * self._lin + self._att * (a + b + 1) * n / 2

    def prefill_flops(self, a: int, b: int) -> float:
        return self._flops(a * self.unit, b * self.unit)

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        return self.cost.kv_bytes_per_token(dtype) * self.unit


@dataclasses.dataclass(frozen=True)
class SimGeometry:
    """What a simulated cache needs to know of the model and the server, in symbols."""

    cost: ModelCostConfig
    unit: int  # real tokens per symbol
    chunked_prefill_size: int  # real tokens
    kv_dtype: str = "bf16"
    evict_watermark: float = 0.02  # fixed pools over budget: evict down to (1 - this) x budget

    @property
    def kv_bytes_per_symbol(self) -> int:
        return self.cost.kv_bytes_per_token(self.kv_dtype) * self.unit

    def checkpoint_bytes(self, dtype: str) -> int:
        return self.cost.checkpoint_bytes(dtype)

    def chunk_ends(self, restore: int, prompt_sym: int) -> list[int]:
        """Absolute ends (symbols) of the prefill chunks from ``restore`` to the prompt end."""
        c = max(1, self.chunked_prefill_size // self.unit)
        ends = list(range(restore + c, prompt_sym, c))
        ends.append(prompt_sym)
        return ends


class SimulatedStore:
    """A :class:`~sglang_k3.cache.ports.CheckpointStore` that holds nothing: handles are ints,
    bytes are counted, nothing is copied. With a ``ledger`` (unified memory) handles and active
    slots are the ledger's; otherwise ``capacity`` (checkpoints) models a fixed checkpoint pool."""

    shares_active_slots = False
    batches_stores = False

    def __init__(
        self,
        dtype: str,
        slot_bytes: int,
        capacity: Optional[int],
        evict_bytes: Callable[[int], object],
        ledger: Optional[BlockLedger] = None,
    ):
        self.dtype, self.slot_bytes, self.capacity = dtype, slot_bytes, capacity
        self._evict_bytes = evict_bytes
        self._next = itertools.count(1)
        self.live: set[int] = set()
        self.ledger = ledger

    def alloc(self) -> Optional[int]:
        if self.ledger is not None:
            h = self.ledger.ckpt_alloc()
            if h is None:
                self._evict_bytes(self.slot_bytes)
                h = self.ledger.ckpt_alloc()
            if h is not None:
                self.live.add(h)
            return h
        if self.capacity is not None and len(self.live) >= self.capacity:
            self._evict_bytes(self.slot_bytes)
            if len(self.live) >= self.capacity:
                return None
        h = next(self._next)
        self.live.add(h)
        return h

    def capture_active(self, active_slot: int) -> Optional[int]:
        return self.alloc()

    def donate(self, active_slot: int) -> Optional[int]:
        return self.alloc()

    def capture_export(self, source, pos: int) -> Optional[int]:
        return self.alloc()

    def store_many(self, active_slots: Sequence[int], handles: Sequence[int]) -> list[bool]:
        return [True] * len(handles)

    def restore(self, handle: int, rid: str, active_slot: int) -> Optional[int]:
        return None

    def cancel_restore(self, rid: str) -> None:
        pass

    def release_active(self, active_slot: int) -> None:
        if self.ledger is not None and active_slot:  # 0: the request got no slot
            self.ledger.active_free(active_slot)

    def free(self, handles: Sequence[int]) -> None:
        for h in handles:
            self.live.remove(h)
            if self.ledger is not None:
                self.ledger.ckpt_free(h)

    def stats(self) -> dict[str, int]:
        return {"store_live": len(self.live)}


@dataclasses.dataclass
class SimExport:
    """One extend's exported grid (every symbol boundary strictly inside it); the rows kept are
    the ones the lifecycle planned when the forward began."""

    prefix: int
    end: int
    planned: frozenset

    def grid(self) -> list[int]:
        return list(range(self.prefix + 1, self.end))

    def kept(self, pos: int) -> bool:
        return pos in self.planned


@dataclasses.dataclass
class Running:
    rid: str
    node: object  # the node the request's path is locked at (None: nothing locked)
    slot: int = 0  # active states are not modelled: no slot
    key: Sequence = ()  # the key its locked path was inserted (or matched) under
    prompt: Sequence = ()  # its prompt's symbols (what the order chooser's miniatures replay)


class SimulatedCache:
    """The k3 cache of ``budget_bytes`` (None: unlimited) under ``k3``, driven request by request:
    :meth:`admit_key` at prefill start (the whole prefill runs then), :meth:`finish_seq` when the
    request's last token is generated. Active states of running requests are not modelled."""

    def __init__(
        self,
        geom: SimGeometry,
        budget_bytes: Optional[float],
        k3: K3Config,
        tiers: Optional[TierPort] = None,
    ):
        self.geom = geom
        self.k3 = k3
        self.budget_bytes = budget_bytes
        slot_bytes = geom.checkpoint_bytes(k3.checkpoint_dtype)
        self.unified = k3.unified_memory and budget_bytes is not None
        self.ledger: Optional[BlockLedger] = None
        capacity = None
        if self.unified:
            ledger_geom = plan_geometry(
                int(budget_bytes),
                kv_token_bytes=geom.kv_bytes_per_symbol,
                active_bytes=geom.checkpoint_bytes("fp32"),
                ckpt_bytes=slot_bytes,
            )
            self.ledger = BlockLedger(
                ledger_geom,
                active_reserve=0,
                min_kv_tokens=-(-k3.min_kv_tokens // geom.unit),
                max_checkpoints=k3.max_checkpoints,
            )
        elif budget_bytes is not None:
            capacity = k3.checkpoint_slots
        self.store = SimulatedStore(k3.checkpoint_dtype, slot_bytes, capacity, self._evict_for_checkpoint, self.ledger)
        ev = EvictionPolicy(cost=ScaledCost(geom.cost, geom.unit), kv_dtype=geom.kv_dtype)
        self.tiers = tiers
        self.lifecycle = build_lifecycle(
            k3,
            self.store,
            ev,
            self._free_kv,
            unit=geom.unit,
            tiers=tiers,
            alloc_kv=self._alloc_kv,
            has_slack=self.ledger.has_slack if self.ledger is not None else None,
        )
        self.evictor = (
            None
            if self.ledger is None
            else UnifiedEviction(self.lifecycle, self.ledger, keep_checkpoints=k3.min_checkpoints)
        )
        self.tree = self.lifecycle.tree
        self.pool_bytes = 0 if capacity is None else capacity * slot_bytes
        self._kv_next = 0
        self.overshoot_max = 0.0
        self.kv_alloc_failures = 0  # chunks whose KV found no room even after eviction (not cached)
        # --k3-eviction-ranking adaptive: miniature caches choose the order (order_chooser.py)
        make = miniature_factory(geom, budget_bytes, k3)
        self.chooser = OrderChooser(self.tree, make) if make is not None else None

    # ------------------------------------------------------------------ memory
    def _evict_for_checkpoint(self, nbytes: int) -> None:
        if self.evictor is None:
            self.lifecycle.evict(num_bytes=nbytes)
        else:
            self.evictor.for_checkpoint(nbytes)

    def _free_kv(self, indices: list[int]) -> None:
        if self.ledger is not None:
            self.ledger.kv_free(indices)

    def _alloc_kv(self, n: int) -> Optional[list[int]]:
        """KV slots for KV a lower tier brings back (as the server's ``_alloc_kv``)."""
        if self.ledger is None:
            fresh = list(range(self._kv_next, self._kv_next + n))
            self._kv_next += n
            return fresh
        got = self.ledger.kv_alloc(n)
        if got is None:
            self.evictor.for_kv(n, n)
            got = self.ledger.kv_alloc(n)
        return got

    def _kv(self, existing: Sequence[int], end: int) -> Optional[list[int]]:
        """KV indices for positions ``[0, end)``: the path's own for the first ``len(existing)``,
        fresh ones after (the server allocates only the new tokens; the tree frees duplicates)."""
        existing = list(existing[:end])
        n = end - len(existing)
        if self.ledger is None:
            fresh = list(range(self._kv_next, self._kv_next + n))
            self._kv_next += n
            return existing + fresh
        led = self.ledger
        got = led.kv_alloc(n)
        if got is None:
            self.evictor.for_kv(n, n)
            got = led.kv_alloc(n)
        if got is None:
            self.kv_alloc_failures += 1
            return None
        return existing + got

    def _path_kv(self, run: Running, key: Sequence) -> list[int]:
        """The request's own KV indices that ``key`` can reuse: its locked path's, up to where
        that path's key and ``key`` part (a prompt ending inside a symbol differs there from the
        full sequence)."""
        if run.node is None:
            return []
        path = self.tree.path_kv(run.node)
        n = min(len(path), len(key), len(run.key))
        j = next((i for i in range(n) if run.key[i] != key[i]), n)
        return path[:j]

    def kv_bytes(self) -> int:
        return self.tree.total_size() * self.geom.kv_bytes_per_symbol

    def enforce_budget(self) -> None:
        """Fixed pools: KV over its share (the budget less the checkpoint pool) is evicted down to
        the low watermark, leaves by utility. Unified: nothing to do, the ledger is the budget and
        every allocation evicts what it needs."""
        if self.budget_bytes is None or self.unified:
            return
        kvb = self.geom.kv_bytes_per_symbol
        low = 1.0 - self.geom.evict_watermark
        while True:
            held = self.kv_bytes() + self.pool_bytes
            if held <= self.budget_bytes:
                break
            freed = self.lifecycle.evict(num_tokens=math.ceil((held - self.budget_bytes * low) / kvb))
            if not freed.kv_indices and not freed.checkpoint_bytes:
                break
        held = self.kv_bytes() + self.pool_bytes
        self.overshoot_max = max(self.overshoot_max, held - self.budget_bytes)

    # ------------------------------------------------------------------ the request's life
    def _lock(self, run: Running, node) -> None:
        """Move the request's path lock to ``node`` (SGLang's ``req.lock``)."""
        if node is self.tree.root:
            node = None
        if node is not None:
            self.tree.inc_lock_ref(node)
        if run.node is not None:
            self.tree.dec_lock_ref(run.node)
        run.node = node

    def _insert(self, run: Running, key, existing: Sequence[int], end: int):
        kv = self._kv(existing, end)
        if kv is None:
            return None
        ins = self.lifecycle.insert(key[:end], kv)
        self._lock(run, ins.node)
        run.key = key
        return None if ins.node is self.tree.root else ins

    def _extend(self, run: Running, key, prefix: int, end: int, existing: Sequence[int]) -> None:
        """One prefill chunk ``(prefix, end]``: the forward exports its grid, then the request
        checkpoints the way the server's ``checkpoint(req, up_to=end)`` does."""
        lc = self.lifecycle
        grid = list(range(prefix + 1, end))
        planned = frozenset(lc.export_plan(run.rid, grid, end))
        ins = self._insert(run, key, existing, end)
        if ins is None:
            return
        lc.store_exports(run.rid, ins.node, end, SimExport(prefix, end, planned))
        lc.checkpoint_running(run.rid, ins.node, end, active_slot=run.slot)

    def start(self, rid: str, key: Sequence):
        """Prefill start of the prompt ``key`` (symbols): the admitted match, ``(match, running
        request)``; ``match.restore_len`` symbols are restored."""
        run = Running(rid=rid, node=None, prompt=key)
        m = self.lifecycle.match(run.rid, key, admit=True, prompt_len=len(key))
        self._lock(run, m.node)  # the matched prefix is the request's (req.lock)
        run.key = key
        if self.chooser is not None:
            self.chooser.admit(rid, key)
        return m, run

    def prefill(self, run: Running, key: Sequence, m) -> None:
        """The prompt's prefill from the match ``m`` on, chunk by chunk."""
        lc = self.lifecycle
        existing: Sequence[int] = m.kv_indices
        prefix = m.restore_len
        for end in self.geom.chunk_ends(m.restore_len, len(key)):
            self._extend(run, key, prefix, end, existing)
            lc.release_pin(run.rid)  # the first forward ran: the copy-on-write has landed
            existing = self._path_kv(run, key)
            prefix = end
        self.enforce_budget()

    def finish_seq(self, run: Running, seq: Sequence, prompt_syms: int, processed: int) -> None:
        """The request's last token was generated: ``seq`` is prompt + output in symbols, of which
        the first ``processed`` went through the model (the last generated token never does) and
        the first ``prompt_syms`` whole symbols were the prompt."""
        lc = self.lifecycle
        for s in range(prompt_syms + 1, processed + 1):
            if lc.decode_due(s):
                ins = self._insert(run, seq, self._path_kv(run, seq), s)
                if ins is not None:
                    lc.checkpoint_running(run.rid, ins.node, s, active_slot=run.slot, kind=CheckpointKind.DECODE)
        if processed > 0:
            ins = self._insert(run, seq, self._path_kv(run, seq), processed)
            if ins is not None:
                lc.finish(ins.node, processed, processed, active_slot=run.slot, rid=run.rid)
        self._lock(run, None)
        lc.release(run.rid)
        self.enforce_budget()
        if self.chooser is not None:
            self.chooser.finish(run.rid, seq, prompt_syms, processed)
