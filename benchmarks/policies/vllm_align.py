"""``vllm-align``: vLLM's hybrid prefix caching in ``--mamba-cache-mode align``, configured on our tree.

Rules modelled (from vLLM's documentation and issues, not its code, which is not installed here):
* Block size: the attention block is enlarged until one attention page is at least one mamba page,
  per layer ("Setting attention block size to 528 tokens to ensure that attention page size is >=
  mamba page size", vllm-project/vllm#40696). Here: ``ceil(state bytes per KDA layer / MLA KV bytes
  per token per layer)`` rounded up to the 64-token hit unit. For Kimi-Linear in fp32 that is
  1920 tokens. Each state occupies one page per KDA layer, so its bytes are the padded
  ``num_kda_layers x block x KV bytes per token per layer``.
* Placement: a state at *every* block boundary the request computes (prefill and decode): "Mamba
  state is stored only on the Mamba block grid, so a prefix-cache hit can resume only at a block
  boundary" and prefix caching "retains a full recurrent-state snapshot once per block_size-token
  boundary" (vLLM docs, automatic prefix caching; vllm-project/vllm#45845). Only whole blocks are
  cached (tree page = block); no branch-point states, no per-path cap.
* Eviction: LRU over one block pool shared by attention and mamba pages (tree: alpha = 0, one
  unified budget; the tree frees LRU leaves with their states).
* States in ``--baseline-state-dtype`` (default fp32; vLLM has no quantised state cache).
"""

from __future__ import annotations

import dataclasses

from benchmarks.policies.base import ScaledCost, SimConfig
from benchmarks.policies.placement_tree import PlacementTreePolicy
from sglang_k3.cache import EvictionPolicy, PlacementPolicy
from sglang_k3.cache.cost_model import DTYPE_BYTES


def block_tokens(cfg: SimConfig) -> int:
    c = cfg.cost
    per_layer_state = (c.recurrent_bytes(cfg.baseline_state_dtype) + c.conv_bytes()) // c.num_kda_layers
    per_layer_token = (c.kv_lora_rank + c.qk_rope_dim) * DTYPE_BYTES[cfg.kv_dtype]
    tokens = -(-per_layer_state // per_layer_token)
    return -(-tokens // cfg.unit) * cfg.unit


class VllmAlignPolicy(PlacementTreePolicy):
    name = "vllm-align"
    use_branch_points = False

    def __init__(self, cfg: SimConfig, budget_bytes):
        self.block = block_tokens(cfg)
        page = self.block // cfg.unit
        self.placement = dataclasses.replace(
            PlacementPolicy(),
            hit_unit=page,
            at_chunk_end=True,
            at_prompt_end=True,
            at_generation_end=True,
            decode_interval=page,
            at_branch_points=False,
            per_path_budget=None,
            recycle_superseded=False,
        )
        c = cfg.cost
        nbytes = c.num_kda_layers * self.block * (c.kv_lora_rank + c.qk_rope_dim) * DTYPE_BYTES[cfg.kv_dtype]
        ev = dataclasses.replace(
            EvictionPolicy(), cost=ScaledCost(cfg.cost, cfg.unit), alpha=0.0, kv_dtype=cfg.kv_dtype
        )
        super().__init__(
            cfg=cfg,
            budget_bytes=budget_bytes,
            page=page,
            hit_unit=page,
            eviction=ev,
            state_dtype=cfg.baseline_state_dtype,
            ckpt_nbytes=nbytes,
        )

    def prefill_chunk_ends(self, restore, prompt_sym):
        p = self.page  # every block boundary the prefill crosses
        return list(range(restore + p, prompt_sym + 1, p)) or [prompt_sym]

    def after_insert(self, node):
        pass  # nothing is recycled: every block keeps its state until evicted

    def summary(self):
        d = super().summary()
        d["block_tokens"] = self.block
        return d
