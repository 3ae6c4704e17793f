"""A :class:`~benchmarks.policies.base.TreePolicy` whose checkpoint positions come from a
``PlacementPolicy``: the driver of the baselines that are modelled as placement rules on the tree
(``marconi``, ``vllm-align``). The ``k3`` policy does not use it: it runs the server's own request
lifecycle (``benchmarks/policies/k3.py``)."""

from __future__ import annotations

import dataclasses

from benchmarks.policies.base import TreePolicy
from sglang_k3.cache import CheckpointKind, PlacementPolicy


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
        return self.placement.plan_prefill(
            prompt_sym, self.prefill_chunk_ends(restore, prompt_sym), restore_len=restore, branch_point=branch
        )

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
