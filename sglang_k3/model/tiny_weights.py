"""Random weights for the tiny model, named as SGLang's ``KimiLinearForCausalLM.load_weights`` expects.

Names follow the public Kimi Linear checkpoints (``block_sparse_moe.experts.E.w1``, ``q_conv1d``,
``A_log``, ...). Scales keep activations O(1) through all layers so greedy outputs are varied.
"""

from __future__ import annotations

import math

import torch

from sglang_k3.model.tiny_spec import TinyK3Spec


def _linear(g: torch.Generator, out_f: int, in_f: int) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)


def _mlp(g, p: str, hidden: int, inter: int, w: dict) -> None:
    w[f"{p}.gate_proj.weight"] = _linear(g, inter, hidden)
    w[f"{p}.up_proj.weight"] = _linear(g, inter, hidden)
    w[f"{p}.down_proj.weight"] = _linear(g, hidden, inter)


def _kda(g, p: str, s: TinyK3Spec, w: dict) -> None:
    proj = s.kda_heads * s.kda_head_dim
    h = s.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        w[f"{p}.{name}.weight"] = _linear(g, proj, h)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        w[f"{p}.{name}.weight"] = torch.randn(proj, 1, s.conv_kernel, generator=g) * 0.5
    w[f"{p}.b_proj.weight"] = _linear(g, s.kda_heads, h)
    w[f"{p}.f_a_proj.weight"] = _linear(g, s.kda_head_dim, h)
    w[f"{p}.f_b_proj.weight"] = _linear(g, proj, s.kda_head_dim)
    w[f"{p}.g_a_proj.weight"] = _linear(g, s.kda_head_dim, h)
    w[f"{p}.g_b_proj.weight"] = _linear(g, proj, s.kda_head_dim)
    # Decay rates exp(A_log) in [kda_decay_min, kda_decay_max): [1, 16) by default, as in
    # Mamba-style initialisation.
    span = s.kda_decay_max - s.kda_decay_min
    w[f"{p}.A_log"] = torch.log(torch.rand(1, 1, s.kda_heads, 1, generator=g) * span + s.kda_decay_min)
    w[f"{p}.dt_bias"] = torch.randn(proj, generator=g) * 0.5 - 2.0
    w[f"{p}.o_norm.weight"] = 1.0 + 0.1 * torch.randn(s.kda_head_dim, generator=g)
    w[f"{p}.o_proj.weight"] = _linear(g, h, proj)


def _mla(g, p: str, s: TinyK3Spec, w: dict) -> None:
    h = s.hidden_size
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    w[f"{p}.q_proj.weight"] = _linear(g, s.mla_heads * qk, h)
    w[f"{p}.kv_a_proj_with_mqa.weight"] = _linear(g, s.kv_lora_rank + s.qk_rope_head_dim, h)
    w[f"{p}.kv_a_layernorm.weight"] = 1.0 + 0.1 * torch.randn(s.kv_lora_rank, generator=g)
    w[f"{p}.kv_b_proj.weight"] = _linear(g, s.mla_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
    w[f"{p}.o_proj.weight"] = _linear(g, h, s.mla_heads * s.v_head_dim)


def _moe(g, p: str, s: TinyK3Spec, w: dict) -> None:
    h, inter = s.hidden_size, s.moe_intermediate_size
    w[f"{p}.gate.weight"] = _linear(g, s.num_experts, h)
    w[f"{p}.gate.e_score_correction_bias"] = 0.01 * torch.randn(s.num_experts, generator=g)
    for e in range(s.num_experts):
        w[f"{p}.experts.{e}.w1.weight"] = _linear(g, inter, h)
        w[f"{p}.experts.{e}.w3.weight"] = _linear(g, inter, h)
        w[f"{p}.experts.{e}.w2.weight"] = _linear(g, h, inter)
    _mlp(g, f"{p}.shared_experts", h, inter * s.shared_experts, w)


def make_weights(s: TinyK3Spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(s.seed)
    w: dict[str, torch.Tensor] = {}
    w["model.embed_tokens.weight"] = torch.randn(s.vocab_size, s.hidden_size, generator=g)
    kda = set(s.kda_layers_1based)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(s.hidden_size, generator=g)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(s.hidden_size, generator=g)
        if (i + 1) in kda:
            _kda(g, f"{p}.self_attn", s, w)
        else:
            _mla(g, f"{p}.self_attn", s, w)
        if i < s.first_dense_layers:
            _mlp(g, f"{p}.mlp", s.hidden_size, s.intermediate_size, w)
        else:
            _moe(g, f"{p}.block_sparse_moe", s, w)
    w["model.norm.weight"] = torch.ones(s.hidden_size)
    w["lm_head.weight"] = _linear(g, s.vocab_size, s.hidden_size) * 4.0
    return {k: v.to(torch.float32).contiguous() for k, v in w.items()}
