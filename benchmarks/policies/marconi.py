"""``marconi``: Marconi-style admission and eviction (Pan et al., "Marconi: Prefix Caching for the
Era of Hybrid LLMs", MLSys 2025), configured on our tree rather than re-implemented.

Rules modelled:
* Admission: a state is checkpointed only at a radix *branch point* found by speculative insertion
  before the prefill (``tree.find_branch_point``) and at the *last token* of a sequence: the end of
  the prompt and the end of the generation. No chunk-end or decode-interval states, no per-path
  cap, nothing recycled.
* Eviction: FLOP-aware utility = recency + alpha x FLOPs saved per byte (the tree's
  ``EvictionPolicy``, alpha = 1 like ours; Marconi tunes alpha online by bootstrapping, which is
  not modelled).
* One memory pool for KV and states; states in ``--checkpoint-dtype`` so that k3 vs marconi compares
  placement and retention only.
Deviations: positions snap down to the 64-token hit unit (Marconi keeps exact last-token states;
the loss is < 64 tokens per hit and the same for k3); Marconi evicts whole nodes with at most one
child, the tree evicts leaves and single checkpoints.
"""

from __future__ import annotations

import dataclasses

from benchmarks.policies.base import ScaledCost, SimConfig
from benchmarks.policies.placement_tree import PlacementTreePolicy, scaled_placement
from sglang_k3.cache import EvictionPolicy, PlacementPolicy


class MarconiPolicy(PlacementTreePolicy):
    name = "marconi"

    def __init__(self, cfg: SimConfig, budget_bytes):
        self.placement = scaled_placement(
            PlacementPolicy(),
            cfg.unit,
            at_chunk_end=False,
            at_prompt_end=True,
            at_generation_end=True,
            at_branch_points=True,
            decode_interval=None,
            per_path_budget=None,
            recycle_superseded=False,
        )
        ev = dataclasses.replace(
            EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), alpha=1.0, kv_dtype=cfg.kv_dtype
        )
        super().__init__(
            cfg=cfg,
            budget_bytes=budget_bytes,
            page=1,
            hit_unit=self.placement.hit_unit,
            eviction=ev,
            state_dtype=cfg.checkpoint_dtype,
        )
