"""``vllm-align``: vLLM's hybrid prefix caching in ``--mamba-cache-mode align``, configured on our tree.

Rules modelled (from vLLM's documentation and issues, not its code, which is not installed here):
* Block size: the attention block is enlarged until one attention page is at least one mamba page,
  per layer ("Setting attention block size to 528 tokens to ensure that attention page size is >=
  mamba page size", vllm-project/vllm#40696). Here: ``ceil(state bytes per KDA layer / MLA KV bytes
  per token per layer)`` rounded up to the 64-token hit unit. For Kimi-Linear in fp32 that is
  1920 tokens. Each state occupies one page per KDA layer, so its bytes are the padded
  ``num_kda_layers x block x KV bytes per token per layer``.
* Placement, prefill: a state at the end of each scheduled *chunk* only, not at every block
  boundary the prefill crosses: ``MambaManager.allocate_new_blocks`` gives a chunk one real state
  block and fills the boundaries inside it with null blocks, which ``cache_full_blocks`` skips
  (vLLM 0.20 ``v1/core/single_type_kv_cache_manager.py:1003``, ``v1/core/block_pool.py:259-262``;
  "in prefill, we snapshot per chunk end", vllm-project/vllm#45845). In align mode the scheduler
  floors a chunk that ends before ``L = floor(P / block) x block`` to a block multiple and cuts the
  chunk that crosses ``L`` at ``L`` (0.20 ``v1/core/sched/scheduler.py:302-350``); the tail past
  ``L`` holds no whole block and no state. The chunk budget is ``--chunked-prefill-size`` (vLLM's
  ``max_num_batched_tokens``, 8192 on an H100/H200: 0.20 ``engine/arg_utils.py:2208-2222``).
  A state at every block boundary (vllm-project/vllm#53479) is an open proposal, not shipped.
* Placement, decode: a state at every block boundary crossed (0.20 ``v1/worker/mamba_utils.py:147-219``;
  "in decode, we snapshot every block size still", #45845). The final partial block's state is
  never cached (0.20 ``single_type_kv_cache_manager.py:299-311``). Only whole blocks are cached
  (tree page = block); no branch-point states, no per-path cap.
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
            at_generation_end=False,  # the last partial block's state is never cached
            decode_interval=page,
            at_branch_points=False,
            per_path_budget=None,
            recycle_superseded=False,
            drop_superseded=False,
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
        p = self.page
        last = prompt_sym // p * p  # the last whole block of the prompt
        chunk = max(p, self.cfg.chunked_prefill_size // self.cfg.unit // p * p)  # floored to blocks
        ends = list(range(restore + chunk, last, chunk))
        if last > restore:
            ends.append(last)  # the chunk crossing it is cut there
        return ends or [prompt_sym]

    def after_insert(self, node):
        pass  # nothing is recycled: every block keeps its state until evicted

    def summary(self):
        d = super().summary()
        d["block_tokens"] = self.block
        return d
