"""``k3``: sglang-k3's cache as the server ships it, driven through the server's own lifecycle.

The policy builds :class:`sglang_k3.cache.lifecycle.CacheLifecycle` with
:func:`~sglang_k3.cache.lifecycle.build_lifecycle` from a :class:`sglang_k3.config.K3Config`: by
default ``K3Config()``, the object ``launch_server`` parses from no ``--k3-*`` flags. Tree, placement,
per-path budget, decode interval, eviction alpha, pins, ready flags and recycling are therefore
the server's, not a model of them; only the units change (positions are symbols of
``cfg.unit`` tokens, the decode interval is divided by it). Each request goes through the verbs the
server's cache calls, in the server's order:

* prefill start: ``match(admit=True)`` (branch point, pin); the copy-on-write lands at the first
  forward: ``release_pin``;
* each prefill chunk end (``--chunked-prefill-size``): ``insert``, then ``store_exports`` of the
  chunk-boundary states the extend exported (planned by ``export_plan`` when the forward began),
  then ``checkpoint_running`` (CHUNK, or PROMPT_END at the prompt end);
* finish: decode-interval checkpoints (``checkpoint_running`` DECODE), ``insert`` of prompt +
  output, ``finish`` (generation end, donated), ``release``.

Memory, as the server holds it (``--k3-checkpoint-dtype int8`` by default): checkpoints live in a
pool of ``--k3-checkpoint-slots`` slots of their own (:class:`SimulatedStore`, which evicts by the
tree's utility when full, as ``QuantizedStore.alloc`` does); MLA KV gets the rest of the budget.
``k3-unified`` is the same lifecycle with one byte budget for KV and checkpoints and no slot
count: a configuration the server does **not** run today (labelled as such in every table).

Deviations (the same for every policy): the whole prefill happens at admission and decode
checkpoints at finish; positions snap to symbols, so a state at a partial symbol (a prompt end
inside 64 tokens) is matched only by the identical prompt.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional, Sequence

from benchmarks.policies.base import Admission, Policy, ScaledCost, SimConfig
from sglang_k3.cache import CheckpointKind, EvictionPolicy
from sglang_k3.cache.lifecycle import build_lifecycle
from sglang_k3.config import K3Config


class SimulatedStore:
    """The replay's :class:`~sglang_k3.cache.lifecycle.CheckpointStore`: handles are ints, bytes
    are counted, nothing is copied. ``capacity`` (checkpoints) models a fixed checkpoint pool; None
    means checkpoints share the byte budget with KV (the caller enforces it)."""

    shares_active_slots = False
    batches_stores = False

    def __init__(self, dtype: str, slot_bytes: int, capacity: Optional[int], evict_bytes: Callable[[int], object]):
        self.dtype, self.slot_bytes, self.capacity = dtype, slot_bytes, capacity
        self._evict_bytes = evict_bytes
        self._next = itertools.count(1)
        self.live: set[int] = set()

    def alloc(self) -> Optional[int]:
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
        pass

    def free(self, handles: Sequence[int]) -> None:
        for h in handles:
            self.live.remove(h)

    def stats(self) -> dict[str, int]:
        return {"store_live": len(self.live)}


@dataclasses.dataclass
class _SimExport:
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
class _Running:
    rid: str
    node: object  # the node the request's path is locked at (None: nothing locked)


class K3Policy(Policy):
    name = "k3"
    unified = False  # the server's layout: a checkpoint pool of its own, KV gets the rest

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None):
        self.cfg = cfg
        self.k3 = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        self.budget_bytes = budget_bytes
        slot_bytes = cfg.checkpoint_bytes(self.k3.checkpoint_dtype)
        capacity = None if self.unified else self.k3.checkpoint_slots
        self.store = SimulatedStore(
            self.k3.checkpoint_dtype, slot_bytes, capacity, lambda n: self.lifecycle.evict(num_bytes=n)
        )
        ev = EvictionPolicy(cost=ScaledCost(cfg.cost, cfg.unit), kv_dtype=cfg.kv_dtype)
        self.lifecycle = build_lifecycle(self.k3, self.store, ev, self._free_kv, unit=cfg.unit)
        self.tree = self.lifecycle.tree
        self.pool_bytes = 0 if capacity is None else capacity * slot_bytes
        self._kv_next = 0
        self._active = itertools.count(1)
        self.overshoot_max = 0.0

    # ------------------------------------------------------------------ memory
    def _free_kv(self, indices: list[int]) -> None:
        """KV indices are only counted (the tree's size is the KV held)."""

    def _kv(self, n: int) -> range:
        r = range(self._kv_next, self._kv_next + n)
        self._kv_next += n
        return r

    def kv_bytes(self) -> int:
        return self.tree.total_size() * self.cfg.kv_bytes_per_symbol

    def sample(self) -> tuple[int, int]:
        return self.kv_bytes(), self.tree.checkpoint_bytes()

    def enforce_budget(self) -> None:
        """KV over its share (the budget less the checkpoint pool, or with ``unified`` the budget
        less the live checkpoints) is evicted down to the low watermark, leaves by utility."""
        if self.budget_bytes is None:
            return
        kvb = self.cfg.kv_bytes_per_symbol
        low = 1.0 - self.cfg.evict_watermark
        while True:
            held = self.kv_bytes() + (self.tree.checkpoint_bytes() if self.unified else self.pool_bytes)
            if held <= self.budget_bytes:
                break
            freed = self.lifecycle.evict(num_tokens=math.ceil((held - self.budget_bytes * low) / kvb))
            if not freed.kv_indices and not freed.checkpoint_bytes:
                break
        held = self.kv_bytes() + (self.tree.checkpoint_bytes() if self.unified else self.pool_bytes)
        self.overshoot_max = max(self.overshoot_max, held - self.budget_bytes)

    # ------------------------------------------------------------------ the request's life
    def _lock(self, run: _Running, node) -> None:
        """Move the request's path lock to ``node`` (SGLang's ``req.lock``)."""
        if node is self.tree.root:
            node = None
        if node is not None:
            self.tree.inc_lock_ref(node)
        if run.node is not None:
            self.tree.dec_lock_ref(run.node)
        run.node = node

    def _extend(self, run: _Running, key, prefix: int, end: int) -> None:
        """One prefill chunk ``(prefix, end]``: the forward exports its grid, then the request
        checkpoints the way the server's ``checkpoint(req, up_to=end)`` does."""
        lc = self.lifecycle
        grid = list(range(prefix + 1, end))
        planned = frozenset(lc.export_plan(run.rid, grid, end))
        ins = lc.insert(key[:end], self._kv(end))
        self._lock(run, ins.node)
        if ins.node is self.tree.root:
            return
        lc.store_exports(run.rid, ins.node, end, _SimExport(prefix, end, planned))
        lc.checkpoint_running(run.rid, ins.node, end, active_slot=0)

    def admit(self, trace, i: int) -> Admission:
        key = trace.prompt(i)
        run = _Running(rid=str(i), node=None)
        lc = self.lifecycle
        m = lc.match(run.rid, key, admit=True, prompt_len=len(key))
        restore = m.restore_len
        prefix = restore
        for end in self.cfg.chunk_ends(restore, len(key)):
            self._extend(run, key, prefix, end)
            lc.release_pin(run.rid)  # the first forward ran: the copy-on-write has landed
            prefix = end
        self.enforce_budget()
        return Admission(
            hit_tokens=restore * self.cfg.unit, mla_tokens=min(m.mla_len, len(key) - 1) * self.cfg.unit, ctx=run
        )

    def finish(self, trace, i: int, run: _Running) -> None:
        lc = self.lifecycle
        L, O, u = trace.input_len[i], trace.output_len[i], self.cfg.unit
        seq = trace.full(i)
        processed = min(len(seq), (L + O - 1) // u)  # the last generated token is never fed back
        for s in range(L // u + 1, processed + 1):
            if lc.decode_due(s):
                ins = lc.insert(seq[:s], self._kv(s))
                self._lock(run, ins.node)
                if ins.node is not self.tree.root:
                    lc.checkpoint_running(run.rid, ins.node, s, active_slot=0, kind=CheckpointKind.DECODE)
        if processed > 0:
            ins = lc.insert(seq[:processed], self._kv(processed))
            self._lock(run, ins.node)
            if ins.node is not self.tree.root:
                lc.finish(ins.node, processed, processed, active_slot=0)
        self._lock(run, None)
        lc.release(run.rid)
        self.enforce_budget()

    def summary(self) -> dict:
        s = self.tree.stats
        return {
            "checkpoints_evicted": s.evicted_checkpoints,
            "checkpoints_recycled": s.recycled_checkpoints,
            "kv_tokens_evicted": s.evicted_kv_tokens * self.cfg.unit,
            "state_bytes_per_checkpoint": self.store.slot_bytes,
            "checkpoint_pool_slots": self.store.capacity,
            "budget_overshoot_bytes_max": self.overshoot_max,
            "k3_config": dataclasses.asdict(self.k3),
        }


class K3UnifiedPolicy(K3Policy):
    """NOT SHIPPED: the server's lifecycle with one byte budget for KV and checkpoints."""

    name = "k3-unified"
    unified = True
