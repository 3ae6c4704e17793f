"""Dimensions of the embedded tiny K3-architecture model, and its HF-style config.

The embedded default is served by SGLang's own ``KimiLinearForCausalLM``: KDA and MLA layers 3:1,
a sparse MoE with a shared expert, MLA without RoPE (as Kimi Linear). Kimi K3's extra features
(attention residuals, latent MoE, output gate) are off: their SGLang code paths are Triton/CUDA
only (``layers/attn_residual.py``'s score kernel; ``torch.cuda.Stream()`` at build time).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

# 256 byte tokens, then the special tokens, in this order.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|sep|>", "<|unused|>")
BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TinyK3Spec:
    hidden_size: int = 256
    num_layers: int = 8
    kda_every: int = 4  # every 4th layer (1-based) is MLA, the rest KDA: 3:1
    kda_heads: int = 4
    kda_head_dim: int = 64
    conv_kernel: int = 4
    mla_heads: int = 4
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    num_experts: int = 8
    experts_per_token: int = 2
    shared_experts: int = 1
    moe_intermediate_size: int = 128
    intermediate_size: int = 512
    first_dense_layers: int = 1
    max_position_embeddings: int = 16384
    # Each KDA head's decay rate exp(A_log) is drawn uniformly from [kda_decay_min, kda_decay_max).
    # The default [1, 16) forgets within a few tokens, so a request's output barely depends on a
    # state restored more than a few tokens before its end; a range such as [0.002, 0.5) keeps
    # some heads' memory for hundreds of tokens, so a wrong restored state shows in the output
    # (the GPU differential's model, benchmarks/gpu_serving.sh).
    kda_decay_min: float = 1.0
    kda_decay_max: float = 16.0
    seed: int = 20261129

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(SPECIAL_TOKENS)

    def token_id(self, special: str) -> int:
        return BYTE_VOCAB + SPECIAL_TOKENS.index(special)

    @property
    def kda_layers_1based(self) -> list[int]:
        return [i for i in range(1, self.num_layers + 1) if i % self.kda_every != 0]

    @property
    def mla_layers_1based(self) -> list[int]:
        return [i for i in range(1, self.num_layers + 1) if i % self.kda_every == 0]

    def fingerprint(self) -> str:
        """Stable short hash of the spec (and the builder version) naming the cache directory."""
        blob = json.dumps({"spec": dataclasses.asdict(self), "builder": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def hf_config(self) -> dict:
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.mla_heads,
            "num_key_value_heads": self.mla_heads,
            "head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": self.max_position_embeddings,
            "q_lora_rank": None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.experts_per_token,
            "num_shared_experts": self.shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            # 1.0: SGLang 0.5.23's native (CPU) MoE path never applies routed_scaling_factor
            # (KimiMoE leaves it to a TopK fusion that only CUDA backends take), so any other
            # value makes the served model differ from the architecture's reference.
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": self.first_dense_layers,
            "moe_layer_freq": 1,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "linear_attn_config": {
                "kda_layers": self.kda_layers_1based,
                "full_attn_layers": self.mla_layers_1based,
                "num_heads": self.kda_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": self.token_id("<|bos|>"),
            "eos_token_id": self.token_id("<|eos|>"),
            "pad_token_id": self.token_id("<|pad|>"),
        }


BUILDER_VERSION = 2
