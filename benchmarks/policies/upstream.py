"""``upstream``: SGLang 0.5.23's hybrid prefix cache (``UnifiedRadixCache`` with FULL + MAMBA
components, ``--mamba-radix-cache-strategy auto`` -> ``extra_buffer``), written from its code and
replayed on our tree. Paths are relative to ``sglang/srt/`` of the pinned install.

Rules, each with its source:

1. **Checkpoint grid = 64 tokens.** ``mamba_checkpoint_grid(page) = lcm(mamba_cache_chunk_size,
   page)`` (runtime_context.py:1966-1971), ``mamba_cache_chunk_size = max(FLA chunk 64, page)``
   (arg_groups/overrides.py:1897-1925); page 1 -> 64 = one symbol here.
2. **One state per prefill chunk, at its last grid point.** Each extend tracks
   ``prefix_len + (extend_len // grid) * grid`` when ``extend_len >= grid``
   (managers/schedule_batch.py:3180-3182); after every chunk the request is checkpointed into the
   tree (``stash_chunked_request`` -> ``checkpoint_kv_cache``, managers/scheduler.py:3772-3776), and
   after the last chunk too (managers/scheduler_components/batch_result_processor.py:393-394). So
   the prompt end (aligned down to 64) and every earlier chunk end get a state.
3. **Branch point replaces the chunk's track.** On a match whose full-attention KV runs past the
   deepest usable state, ``mamba_branching_seqlen`` = the KV hit aligned down to the grid
   (unified_cache/components/mamba.py:164-188); the chunk that contains it tracks the branch point
   *instead of* its own end (managers/schedule_batch.py:3216-3232).
4. **KV is inserted only up to the tracked state.** The insert key is cut at
   ``effective_cache_len = min(..., mamba cache_len)`` (mem_cache/unified_radix_cache.py:1191-1205,
   cache_len = ``mamba_last_track_seqlen``, unified_cache/components/mamba.py:606-612); the rest of
   the request's KV is freed on release (mem_cache/common.py:431-433).
5. **Decode: a state every ``mamba_track_interval`` = 256 tokens, only the last one kept.** Default
   256 (arg_groups/fields/exec_.py:530-533); decode grid ``lcm(64, 256)`` (runtime_context.py:1974-1979);
   a track fires when ``seq_len % 256 == 0`` (managers/schedule_batch.py:3803-3819,
   managers/scheduler_components/batch_result_processor.py:1400-1406) into a ping-pong pair, and on
   finish the latest tracked state is donated with the key cut at its length
   (unified_cache/components/mamba.py:582-602). A turn whose decode crosses no multiple of 256 adds
   no new state.
6. **No per-path cap by default.** ``mamba_max_states_per_path = -1`` (arg_groups/fields/exec_.py:497-503;
   the cap is skipped when < 0, unified_cache/components/mamba.py:279-281). Nothing is recycled.
7. **LRU for both resources.** Full KV evicts LRU leaves by ``last_access_time``; the MAMBA
   component has its own LRU in which a match touches only the state it used
   (unified_cache/components/mamba.py:127-149) and eviction tombstones internal states (KV kept) and
   deletes leaves (unified_cache/components/README.md:159-161). Tree: ``EvictionPolicy(alpha=0)``.
8. **Static pools, fp32 states.** Without ``--enable-unified-memory`` (default False,
   arg_groups/fields/memory.py:78-85) the state pool gets ``ratio / (1 + ratio)`` of the memory with
   ``mamba_full_memory_ratio`` falling back to 0.9 (arg_groups/fields/schedule.py:220-226,
   mem_cache/kv_cache_configurator.py:3352-3356): 47% states, 53% KV. The int8 checkpoint pool is
   opt-in (``enable_int8_mamba_checkpoint = False``, arg_groups/fields/exec_.py:534-537), so states
   are stored in the model's dtype: ``--baseline-state-dtype`` (fp32 for Kimi-Linear).

Deviations (small, stated): the tree locks a running request's whole path for KV *and* states
(upstream locks one node's state); a state evicted from a leaf leaves its KV until KV pressure
(upstream deletes the leaf at once), so that KV can still produce a branch point; the active and
ping-pong slots of running requests are not charged to the state pool (for no policy).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from benchmarks.policies.base import ScaledCost, SimConfig, TreePolicy, _Ctx
from sglang_k3.cache import CheckpointKind, EvictionPolicy

TRACK_INTERVAL = 256  # mamba_track_interval default (rule 5)


class UpstreamPolicy(TreePolicy):
    name = "upstream"

    def __init__(self, cfg: SimConfig, budget_bytes, state_dtype: Optional[str] = None, state_pool_bytes=None):
        if TRACK_INTERVAL % cfg.unit:
            raise ValueError(f"symbol size {cfg.unit} must divide the track interval {TRACK_INTERVAL}")
        ev = dataclasses.replace(
            EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), alpha=0.0, kv_dtype=cfg.kv_dtype
        )
        r = cfg.upstream_mamba_ratio
        super().__init__(
            cfg=cfg,
            budget_bytes=budget_bytes,
            page=1,
            hit_unit=1,
            eviction=ev,
            state_dtype=state_dtype or cfg.baseline_state_dtype,
            pool="split",
            state_share=r / (1 + r),
            state_pool_bytes=state_pool_bytes,
            insert_to_last_checkpoint=True,
        )

    def plan_prefill(self, prompt_sym, key_len, restore, mla_len, branch):
        u = self.cfg.unit
        kv_hit = min(mla_len, key_len - 1)
        branching = kv_hit if kv_hit > restore else None  # rule 3 (already grid-aligned)
        plan: dict[int, CheckpointKind] = {}
        chunk = self.cfg.chunked_prefill_size
        start = restore * u
        L_real = self._L_real  # the prompt length in real tokens (set by admit)
        while start < L_real:
            end = min(start + chunk, L_real)
            ext = end - start
            if ext >= u:  # rule 2
                track = start // u + ext // u
                kind = CheckpointKind.PROMPT_END if end == L_real else CheckpointKind.CHUNK
                if branching is not None and start // u < branching and branching * u < end:
                    track, kind = branching, CheckpointKind.BRANCH  # rule 3
                plan[track] = kind
            start = end
        return plan

    def admit(self, trace, i):
        self._L_real = trace.input_len[i]
        return super().admit(trace, i)

    def plan_finish(self, L, O, ctx: _Ctx):
        last = (L + O - 1) // TRACK_INTERVAL * TRACK_INTERVAL  # rule 5: latest decode track
        if last > L:
            return {last // self.cfg.unit: CheckpointKind.DECODE | CheckpointKind.GEN_END}
        return {}  # no new state: the finish insert re-touches the prefill's state (rule 4)


INT8_POOL_SLOTS_PER_MAMBA_SLOT = 2  # ckpt_size = int8_mamba_ckpt_size or 2 * mamba_size


class UpstreamInt8Policy(UpstreamPolicy):
    """``upstream-int8``: the same cache with SGLang's opt-in ``--enable-int8-mamba-checkpoint``
    (``enable_int8_mamba_checkpoint = False`` by default, arg_groups/fields/exec_.py:534-537).
    Rules 1-7 are unchanged (placement and eviction do not look at the flag:
    unified_cache/components/mamba.py:80-85, 255-320); what changes is where the tree's states live:

    * **A separate int8 checkpoint pool** (``HybridReqToTokenPool.mamba_ckpt_pool``,
      mem_cache/memory_pool.py:1497-1516) of ``2 x max_mamba_cache_size`` slots
      (mem_cache/mamba_checkpoint_pool.py:330). Every tree state is quantized into it on insert and
      dequantized into an active slot on a hit (mamba_checkpoint_pool.py:246-254); the recurrent
      state is int8 with per-(head, channel) scales, the conv state stays native
      (mamba_checkpoint_pool.py:119-136, 216-224): ``--checkpoint-dtype``-independent, the model's
      int8 checkpoint bytes here.
    * **The KV / state split is unchanged** (kv_cache_configurator.py:3346-3407 ignores the flag), so
      KV keeps ``1 / (1 + ratio)`` of the budget and the fp32 state pool its ``ratio / (1 + ratio)``,
      now holding only running requests' states (not modelled, as for every policy), and
      ``max_mamba_cache_size`` = that share / one fp32 state.
    * **The checkpoint pool is extra memory**, "NOT subtracted from the KV-cache budget"
      (mamba_checkpoint_pool.py:364-372): this policy holds more than the budget, by the pool's
      bytes (``state_pool_bytes`` in its record).
    """

    name = "upstream-int8"

    def __init__(self, cfg: SimConfig, budget_bytes):
        pool = None
        if budget_bytes is not None:
            r = cfg.upstream_mamba_ratio
            mamba_slots = int(budget_bytes * r / (1 + r) // cfg.checkpoint_bytes(cfg.baseline_state_dtype))
            pool = INT8_POOL_SLOTS_PER_MAMBA_SLOT * mamba_slots * cfg.checkpoint_bytes("int8")
        super().__init__(cfg, budget_bytes, state_dtype="int8", state_pool_bytes=pool)

    def summary(self):
        d = super().summary()
        d["state_pool_bytes"] = self.state_pool_bytes
        return d
