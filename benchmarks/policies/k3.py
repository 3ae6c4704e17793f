"""``k3``: sglang-k3's cache as the server ships it, driven through the server's own lifecycle.

The policy builds :class:`sglang_k3.cache.lifecycle.CacheLifecycle` with
:func:`~sglang_k3.cache.build.build_lifecycle` from a :class:`sglang_k3.config.K3Config`: by
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

Memory, as the server holds it by default (unified memory, ``--k3-checkpoint-dtype int8``): the
budget is one :class:`~sglang_k3.cache.block_ledger.BlockLedger`, cut by the server's own
``plan_geometry`` into blocks that hold ``ckpt_per_block`` checkpoints or ``kv_per_block`` symbols
of MLA KV (an fp32 active state spans ``active_span`` blocks). KV symbols, checkpoint handles and active slots are the
ledger's indices, so block packing, the checkpoint stride's padding and fragmentation are modelled,
not assumed away. A shortage of any kind evicts KV and checkpoints together by value until the
ledger has room (``CacheLifecycle.evict_until``), as the server's cache does. Active states of
running requests are not modelled, as for every policy here (none of them counts its running
requests' states); the server holds them in the same budget (``R`` blocks held back).
``k3-fixed`` is ``--k3-no-unified-memory``: checkpoints in a pool of ``--k3-checkpoint-slots`` of
their own (:class:`SimulatedStore` evicts by the tree's utility when full, as
``QuantizedStore.alloc`` does), MLA KV in the rest of the budget, active states not counted.

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
from benchmarks.policies.tiers import build_sim_tiers, load_seconds
from sglang_k3.cache import CheckpointKind, EvictionPolicy
from sglang_k3.cache.block_ledger import BlockLedger, plan_geometry
from sglang_k3.cache.build import build_lifecycle
from sglang_k3.cache.unified_eviction import UnifiedEviction
from sglang_k3.config import K3Config


class SimulatedStore:
    """The replay's :class:`~sglang_k3.cache.ports.CheckpointStore`: handles are ints, bytes
    are counted, nothing is copied. With a ``ledger`` (unified memory) handles and active slots are
    the ledger's; otherwise ``capacity`` (checkpoints) models a fixed checkpoint pool."""

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
    slot: int = 0  # active states are not modelled: no slot
    key: Sequence = ()  # the key its locked path was inserted (or matched) under


class K3Policy(Policy):
    name = "k3"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        self.cfg = cfg
        self.k3 = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        if cfg.tier_park_interval is not None:
            self.k3 = dataclasses.replace(self.k3, tier_park_interval=cfg.tier_park_interval)
        self.budget_bytes = budget_bytes
        slot_bytes = cfg.checkpoint_bytes(self.k3.checkpoint_dtype)
        self.unified = self.k3.unified_memory and budget_bytes is not None
        self.ledger: Optional[BlockLedger] = None
        capacity = None
        if self.unified:
            geom = plan_geometry(
                int(budget_bytes),
                kv_token_bytes=cfg.kv_bytes_per_symbol,
                active_bytes=cfg.checkpoint_bytes("fp32"),
                ckpt_bytes=slot_bytes,
            )
            self.ledger = BlockLedger(
                geom,
                active_reserve=0,
                min_kv_tokens=-(-self.k3.min_kv_tokens // cfg.unit),
                max_checkpoints=self.k3.max_checkpoints,
            )
        elif budget_bytes is not None:
            capacity = self.k3.checkpoint_slots
        self.store = SimulatedStore(
            self.k3.checkpoint_dtype, slot_bytes, capacity, self._evict_for_checkpoint, self.ledger
        )
        ev = EvictionPolicy(cost=ScaledCost(cfg.cost, cfg.unit), kv_dtype=cfg.kv_dtype)
        self.tiers = build_sim_tiers(cfg, slot_bytes, shared_l3, self.k3.tier_write_policy)
        self.lifecycle = build_lifecycle(
            self.k3,
            self.store,
            ev,
            self._free_kv,
            unit=cfg.unit,
            tiers=self.tiers,
            alloc_kv=self._alloc_kv,
            has_slack=self.ledger.has_slack if self.ledger is not None else None,
        )
        self.evictor = (
            None
            if self.ledger is None
            else UnifiedEviction(self.lifecycle, self.ledger, keep_checkpoints=self.k3.min_checkpoints)
        )
        self.tree = self.lifecycle.tree
        self.pool_bytes = 0 if capacity is None else capacity * slot_bytes
        self._kv_next = 0
        self.overshoot_max = 0.0
        self.kv_alloc_failures = 0  # chunks whose KV found no room even after eviction (not cached)

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

    def _tier_snapshot(self) -> tuple:
        if self.tiers is None:
            return ()
        c = self.tiers.counters
        return (c.loads, c.load_kv_tokens, dict(self.tiers.hits_by_tier))

    def _load_seconds(self, before: tuple) -> float:
        """The time the admission's tier load took, at the tiers' modelled link rates."""
        if self.tiers is None:
            return 0.0
        loads, kv_syms, hits = before
        c = self.tiers.counters
        if c.loads == loads:
            return 0.0
        tier = next(n for n, k in self.tiers.hits_by_tier.items() if k > hits.get(n, 0))
        nbytes = (c.load_kv_tokens - kv_syms) * self.cfg.kv_bytes_per_symbol + self.store.slot_bytes
        return load_seconds(self.cfg, tier, nbytes)

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

    def _path_kv(self, run: _Running, key: Sequence) -> list[int]:
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
        return self.tree.total_size() * self.cfg.kv_bytes_per_symbol

    def sample(self) -> tuple[int, int]:
        return self.kv_bytes(), self.tree.checkpoint_bytes()

    def enforce_budget(self) -> None:
        """Fixed pools: KV over its share (the budget less the checkpoint pool) is evicted down to
        the low watermark, leaves by utility. Unified: nothing to do, the ledger is the budget and
        every allocation evicts what it needs."""
        if self.budget_bytes is None or self.unified:
            return
        kvb = self.cfg.kv_bytes_per_symbol
        low = 1.0 - self.cfg.evict_watermark
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
    def _lock(self, run: _Running, node) -> None:
        """Move the request's path lock to ``node`` (SGLang's ``req.lock``)."""
        if node is self.tree.root:
            node = None
        if node is not None:
            self.tree.inc_lock_ref(node)
        if run.node is not None:
            self.tree.dec_lock_ref(run.node)
        run.node = node

    def _insert(self, run: _Running, key, existing: Sequence[int], end: int):
        kv = self._kv(existing, end)
        if kv is None:
            return None
        ins = self.lifecycle.insert(key[:end], kv)
        self._lock(run, ins.node)
        run.key = key
        return None if ins.node is self.tree.root else ins

    def _extend(self, run: _Running, key, prefix: int, end: int, existing: Sequence[int]) -> None:
        """One prefill chunk ``(prefix, end]``: the forward exports its grid, then the request
        checkpoints the way the server's ``checkpoint(req, up_to=end)`` does."""
        lc = self.lifecycle
        grid = list(range(prefix + 1, end))
        planned = frozenset(lc.export_plan(run.rid, grid, end))
        ins = self._insert(run, key, existing, end)
        if ins is None:
            return
        lc.store_exports(run.rid, ins.node, end, _SimExport(prefix, end, planned))
        lc.checkpoint_running(run.rid, ins.node, end, active_slot=run.slot)

    def admit(self, trace, i: int) -> Admission:
        key = trace.prompt(i)
        run = _Running(rid=str(i), node=None)
        lc = self.lifecycle
        before = self._tier_snapshot()
        m = lc.match(run.rid, key, admit=True, prompt_len=len(key))
        load_s = self._load_seconds(before)
        restore = m.restore_len
        self._lock(run, m.node)  # the matched prefix is the request's (req.lock)
        run.key = key
        existing: Sequence[int] = m.kv_indices
        prefix = restore
        for end in self.cfg.chunk_ends(restore, len(key)):
            self._extend(run, key, prefix, end, existing)
            lc.release_pin(run.rid)  # the first forward ran: the copy-on-write has landed
            existing = self._path_kv(run, key)
            prefix = end
        self.enforce_budget()
        return Admission(
            hit_tokens=restore * self.cfg.unit,
            mla_tokens=min(m.mla_len, len(key) - 1) * self.cfg.unit,
            ctx=run,
            load_s=load_s,
        )

    def finish(self, trace, i: int, run: _Running) -> None:
        lc = self.lifecycle
        L, O, u = trace.input_len[i], trace.output_len[i], self.cfg.unit
        seq = trace.full(i)
        processed = min(len(seq), (L + O - 1) // u)  # the last generated token is never fed back
        for s in range(L // u + 1, processed + 1):
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

    def summary(self) -> dict:
        s = self.tree.stats
        out = {
            "checkpoints_evicted": s.evicted_checkpoints,
            "checkpoints_recycled": s.recycled_checkpoints,
            "kv_tokens_evicted": s.evicted_kv_tokens * self.cfg.unit,
            "state_bytes_per_checkpoint": self.store.slot_bytes,
            "checkpoint_pool_slots": self.store.capacity,
            "budget_overshoot_bytes_max": self.overshoot_max,
            "k3_config": dataclasses.asdict(self.k3),
            "unified_memory": self.unified,
            "kv_alloc_failures": self.kv_alloc_failures,
            # prompt tokens not restored, by cause (sglang_k3/cache/ghosts.py), in real tokens
            "misses": {k: v * self.cfg.unit for k, v in self.tree.misses.as_dict().items()},
            "reuse": (self.tree.reuse.as_dict() if self.tree.reuse is not None else None),
        }
        if self.tiers is not None:
            t = self.tiers.stats()
            unit = self.cfg.unit
            out["tiers"] = {
                "hits": dict(self.tiers.hits_by_tier),
                "hit_tokens_gained": t["tier_load_tokens"] * unit,
                "kv_tokens_loaded": t["tier_load_kv_tokens"] * unit,
                "boundaries_saved": t["tier_saves"],
                "save_failures": t["tier_save_failures"],
                "no_memory": t["tier_load_no_memory"],
                "parked": self.lifecycle.bridge.counters.tier_parked,
                **{k: v for k, v in t.items() if k.endswith(("_bytes", "_objects", "_evictions"))},
            }
        if self.ledger is not None:
            g, c = self.ledger.geom, self.ledger.counters
            out["unified"] = {
                "block_bytes": g.block_bytes,
                "num_blocks": g.num_blocks,
                "kv_symbols_per_block": g.kv_per_block,
                "checkpoints_per_block": g.ckpt_per_block,
                "blocks_to_kv": c.blocks_to_kv,
                "blocks_to_checkpoints": c.blocks_to_ckpt,
                "peak_kv_bytes": c.peak_kv_blocks * g.block_bytes,
                "peak_checkpoint_bytes": c.peak_ckpt_blocks * g.block_bytes,
                "reclaims": c.reclaims,
                "reclaim_evicted_bytes": c.reclaim_evicted_bytes,
            }
        return out


class K3Alpha0Policy(K3Policy):
    """``--k3-eviction-alpha 0`` (a tuned variant, not the default): eviction by recency alone,
    after dead KV tails (superseded states, priced at 0, rank by recency like the rest). What
    Marconi's own bootstrap picks at 40-80 GiB on the conversation trace."""

    name = "k3-alpha0"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, eviction_alpha=0.0))


class K3FixedPolicy(K3Policy):
    """``--k3-no-unified-memory``: a checkpoint pool of ``--k3-checkpoint-slots`` of its own, KV in
    the rest of the budget (the layout before unified memory; not the default)."""

    name = "k3-fixed"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, unified_memory=False))


class K3RulesPolicy(K3Policy):
    """``--k3-no-adaptive-retention`` (not the default): the placement rules that let states go
    (recycling superseded chunk ends, one state per turn) apply always, as before the reuse
    learner (sglang_k3/cache/ghosts.py). Shown beside ``k3`` to measure what the learner does."""

    name = "k3-rules"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, adaptive_retention=False), shared_l3)


class K3EagerPolicy(K3Policy):
    """``--k3-eager-drops`` (not the default): a state the placement rules let go leaves at once,
    even while the budget has free memory (before lazy drops). Shown beside ``k3`` to measure what
    deferring those drops to a shortage does."""

    name = "k3-eager"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, lazy_drops=False), shared_l3)
