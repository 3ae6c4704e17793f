"""``k3``: sglang-k3's own cache with its defaults, i.e. the tree exactly as shipped.

* Placement: ``sglang_k3.cache.PlacementPolicy()`` defaults (prefill chunk ends, prompt end,
  generation end, radix branch points from ``tree.find_branch_point``, per-path budget 8, recycle
  superseded intermediates, no decode interval). Only the unit changes: positions are symbols of
  64 tokens, so ``hit_unit`` is 1 symbol (= 64 tokens, the tree's default) and a decode interval,
  if the default ever sets one, is divided by the symbol size.
* Eviction: ``EvictionPolicy()`` defaults (alpha = 1: recency + FLOPs saved per byte) with the
  model's FLOP/byte model.
* Checkpoints in ``--checkpoint-dtype`` (recurrent state; conv state stays bf16, as the codec keeps
  it); one unified byte pool for KV and checkpoints.
"""
from __future__ import annotations

import dataclasses

from sglang_k3.cache import CheckpointKind, EvictionPolicy, PlacementPolicy

from benchmarks.policies.base import ScaledCost, SimConfig, TreePolicy


def scaled_placement(base: PlacementPolicy, unit: int, **overrides) -> PlacementPolicy:
    """``base`` with positions in symbols of ``unit`` real tokens."""
    if base.hit_unit % unit and unit % base.hit_unit:
        raise ValueError(f"hit unit {base.hit_unit} and symbol size {unit} are incompatible")
    interval = base.decode_interval
    if interval:
        interval = max(1, interval // unit)
    fields = dict(hit_unit=max(1, base.hit_unit // unit), decode_interval=interval)
    fields.update(overrides)
    return dataclasses.replace(base, **fields)


class PlacementTreePolicy(TreePolicy):
    """A TreePolicy whose checkpoint positions come from a ``PlacementPolicy``."""

    placement: PlacementPolicy
    use_branch_points = True

    def branch_point(self, key):
        if self.placement.at_branch_points and self.use_branch_points:
            return self.tree.find_branch_point(key)
        return None

    def prefill_chunk_ends(self, restore: int, prompt_sym: int) -> list[int]:
        return self.cfg.chunk_ends(restore, prompt_sym)

    def plan_prefill(self, prompt_sym, key_len, restore, mla_len, branch):
        return self.placement.plan_prefill(prompt_sym, self.prefill_chunk_ends(restore, prompt_sym),
                                           restore_len=restore, branch_point=branch)

    def plan_finish(self, L, O, ctx):
        u = self.cfg.unit
        processed = (L + O - 1) // u  # the last generated token is never fed back
        plan: dict[int, CheckpointKind] = {}
        if self.placement.decode_interval:
            for s in range(L // u + 1, processed + 1):
                if self.placement.decode_checkpoint(s):
                    plan[s] = CheckpointKind.DECODE
        g = self.placement.generation_end(processed)
        if g is not None and g > 0:
            plan[g] = plan.get(g, CheckpointKind(0)) | CheckpointKind.GEN_END
        return plan

    def after_insert(self, node):
        self.tree.recycle_path(node, self.placement)


class K3Policy(PlacementTreePolicy):
    name = "k3"

    def __init__(self, cfg: SimConfig, budget_bytes):
        self.placement = scaled_placement(PlacementPolicy(), cfg.unit)
        ev = dataclasses.replace(EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), kv_dtype=cfg.kv_dtype)
        super().__init__(cfg=cfg, budget_bytes=budget_bytes, page=1, hit_unit=self.placement.hit_unit,
                         eviction=ev, state_dtype=cfg.checkpoint_dtype)
