"""``k3``: sglang-k3's cache as the server ships it, driven through the server's own lifecycle.

The policy is :class:`sglang_k3.cache.simulated.SimulatedCache`: the server's
:class:`~sglang_k3.cache.lifecycle.CacheLifecycle`, built with
:func:`~sglang_k3.cache.build.build_lifecycle` from a :class:`sglang_k3.config.K3Config` (by
default ``K3Config()``, the object ``launch_server`` parses from no ``--k3-*`` flags), driven through
the verbs the server's cache calls, in the server's order (that module lists them). Tree,
placement, per-path budget, decode interval, eviction order, pins, ready flags and recycling are
therefore the server's, not a model of them; only the units change (positions are symbols of
``cfg.unit`` tokens, the decode interval is divided by it). This module adds the replay's
interface, the lower tiers' modelled load time and the summary.

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
from typing import Optional

from benchmarks.policies.base import Admission, Policy, SimConfig
from benchmarks.policies.tiers import build_sim_tiers, load_seconds
from sglang_k3.cache.simulated import SimGeometry, SimulatedCache, SimulatedStore  # noqa: F401  (re-exported)
from sglang_k3.config import K3Config


class K3Policy(SimulatedCache, Policy):
    name = "k3"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        self.cfg = cfg
        k3 = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        if cfg.tier_park_interval is not None:
            k3 = dataclasses.replace(k3, tier_park_interval=cfg.tier_park_interval)
        geom = SimGeometry(
            cost=cfg.cost,
            unit=cfg.unit,
            chunked_prefill_size=cfg.chunked_prefill_size,
            kv_dtype=cfg.kv_dtype,
            evict_watermark=cfg.evict_watermark,
        )
        slot_bytes = cfg.checkpoint_bytes(k3.checkpoint_dtype)
        tiers = build_sim_tiers(cfg, slot_bytes, shared_l3, k3.tier_write_policy)
        super().__init__(geom, budget_bytes, k3, tiers)

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

    def sample(self) -> tuple[int, int]:
        return self.kv_bytes(), self.tree.checkpoint_bytes()

    def admit(self, trace, i: int) -> Admission:
        key = trace.prompt(i)
        before = self._tier_snapshot()
        m, run = self.start(str(i), key)
        load_s = self._load_seconds(before)
        self.prefill(run, key, m)
        return Admission(
            hit_tokens=m.restore_len * self.cfg.unit,
            mla_tokens=min(m.mla_len, len(key) - 1) * self.cfg.unit,
            ctx=run,
            load_s=load_s,
        )

    def finish(self, trace, i: int, run) -> None:
        L, O, u = trace.input_len[i], trace.output_len[i], self.cfg.unit
        seq = trace.full(i)
        processed = min(len(seq), (L + O - 1) // u)  # the last generated token is never fed back
        self.finish_seq(run, seq, L // u, processed)

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
            "eviction_order": self.tree.order,
            "order_chooser": self.chooser.stats() if self.chooser is not None else None,
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


class K3DensityPolicy(K3Policy):
    """``--k3-eviction-ranking density`` (an experiment, not the default): checkpoints rank by
    learned hit density (sglang_k3/cache/hit_density.py) instead of the recency and efficiency
    blend. Shown beside ``k3`` to measure what the learned order does."""

    name = "k3-lhd"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, eviction_ranking="density"), shared_l3)


class K3AdaptivePolicy(K3Policy):
    """``--k3-eviction-ranking adaptive``: miniature caches of an eighth of the budget, fed one
    request in eight, choose between the blend and hit density while the replay runs
    (sglang_k3/cache/order_chooser.py)."""

    name = "k3-adaptive"

    def __init__(self, cfg: SimConfig, budget_bytes, k3: Optional[K3Config] = None, shared_l3=None):
        base = k3 or dataclasses.replace(K3Config(), checkpoint_dtype=cfg.checkpoint_dtype)
        super().__init__(cfg, budget_bytes, dataclasses.replace(base, eviction_ranking="adaptive"), shared_l3)
