"""FLOP and byte model of a KDA/MLA/MoE hybrid, for eviction utility and the simulator.

Eviction ranks a checkpoint by the prefill FLOPs it saves per byte it holds (Marconi-style), so the
model must price the three terms that differ by position: KDA (linear in tokens), MLA (its
attention term grows with the prefix), MoE (linear, only the activated experts). Counts are
multiply-adds x 2; norms, activations, router softmax and the LM head (computed for one token per
prefill) are ignored: they are small or position-independent.

Presets:
- ``kimi-linear-48b``: Kimi-Linear-48B-A3B. Source: the public model config as mirrored by the
  torchtitan ``KimiLinearModelArgs`` defaults (hidden 2304, 27 layers, MLA at 1-based layers
  4,8,12,16,20,24,27 -> 7 MLA + 20 KDA, KDA 32 heads x 128, conv kernel 4, MLA 32 heads,
  nope 128 / rope 64 / v 128, kv_lora_rank 512, no q LoRA, moe_inter 1024, first dense layer with
  intermediate 9216, vocab 163840); experts 256 / top-8 / 1 shared from memory of the HF
  config.json (not re-verified here).
- ``k3``: 93 layers (69 KDA, 24 MLA), hidden 7168, 896 experts top-16 as given in the K3 brief;
  head counts, MoE width and q LoRA are assumptions (DeepSeek-V3-like MLA, 64 KDA heads x 128).
- ``tiny``: the embedded test model's scale (hidden 256, 8 layers, 6 KDA + 2 MLA).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


@dataclass(frozen=True)
class ModelCostConfig:
    name: str
    hidden: int
    vocab: int
    num_kda_layers: int
    kda_heads: int
    kda_head_k: int
    kda_head_v: int
    kda_conv_kernel: int
    num_mla_layers: int
    mla_heads: int
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int
    q_lora_rank: int  # 0: q projected directly from hidden
    num_experts: int
    top_k: int
    moe_intermediate: int
    num_shared_experts: int
    first_k_dense: int
    dense_intermediate: int

    @property
    def num_layers(self) -> int:
        return self.num_kda_layers + self.num_mla_layers

    # ---- bytes ---------------------------------------------------------------------------
    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """MLA latent cache: (kv_lora_rank + rope) per token per MLA layer."""
        return (self.kv_lora_rank + self.qk_rope_dim) * DTYPE_BYTES[dtype] * self.num_mla_layers

    def recurrent_bytes(self, dtype: str = "fp32") -> int:
        """KDA recurrent state over all KDA layers. int8 adds one fp32 scale per (head, k),
        taken over V (the codec's layout)."""
        per_layer = self.kda_heads * self.kda_head_k * self.kda_head_v * DTYPE_BYTES[dtype]
        if dtype == "int8":
            per_layer += self.kda_heads * self.kda_head_k * 4
        return per_layer * self.num_kda_layers

    def conv_bytes(self, dtype: str = "bf16") -> int:
        """Short-conv window over q, k, v channels: (kernel - 1) positions, kept in native dtype."""
        channels = self.kda_heads * (2 * self.kda_head_k + self.kda_head_v)
        return channels * (self.kda_conv_kernel - 1) * DTYPE_BYTES[dtype] * self.num_kda_layers

    def checkpoint_bytes(self, dtype: str = "fp32", conv_dtype: str = "bf16") -> int:
        return self.recurrent_bytes(dtype) + self.conv_bytes(conv_dtype)

    # ---- FLOPs ---------------------------------------------------------------------------
    def _kda_linear_flops_per_token(self) -> int:
        h, hk, hv = self.hidden, self.kda_heads * self.kda_head_k, self.kda_heads * self.kda_head_v
        proj = h * (2 * hk + hv)  # q, k, v
        gates = 2 * (h * self.kda_head_k + self.kda_head_k * hk)  # low-rank decay gate + output gate
        beta = h * self.kda_heads
        out = hv * h
        conv = (2 * hk + hv) * self.kda_conv_kernel
        # delta-rule recurrence per head: k^T S, rank-1 update, q S (each ~ dk * dv MACs) + decay
        recur = self.kda_heads * 4 * self.kda_head_k * self.kda_head_v
        return 2 * (proj + gates + beta + out + conv + recur)

    def _mla_linear_flops_per_token(self) -> int:
        h, nh = self.hidden, self.mla_heads
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * nh * qk) if self.q_lora_rank else h * nh * qk
        kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
        kv_b = self.kv_lora_rank * nh * (self.qk_nope_dim + self.v_head_dim)
        o = nh * self.v_head_dim * h
        return 2 * (q + kv_a + kv_b + o)

    def _mla_attn_flops_per_context_token(self) -> int:
        """Cost of one query attending to one earlier token (QK^T and AV)."""
        return 2 * self.mla_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)

    def _ffn_flops_per_token(self) -> int:
        dense = 3 * self.hidden * self.dense_intermediate
        moe = self.hidden * self.num_experts + 3 * self.hidden * self.moe_intermediate * (
            self.top_k + self.num_shared_experts
        )
        n_dense = min(self.first_k_dense, self.num_layers)
        return 2 * (n_dense * dense + (self.num_layers - n_dense) * moe)

    @cached_property
    def _linear_flops_per_token(self) -> int:
        """Every layer's per-token FLOPs that do not depend on the context length."""
        return (
            self.num_kda_layers * self._kda_linear_flops_per_token()
            + self.num_mla_layers * self._mla_linear_flops_per_token()
            + self._ffn_flops_per_token()
        )

    @cached_property
    def _attn_flops_per_context_token(self) -> int:
        return self.num_mla_layers * self._mla_attn_flops_per_context_token()

    def prefill_flops(self, a: int, b: int) -> float:
        """FLOPs to prefill tokens [a, b) given that the prefix [0, a) is cached. Eviction asks it
        for every candidate checkpoint at every shortage, so the per-token constants are computed
        once per model (the same integers, so the same floats)."""
        if b <= a:
            return 0.0
        n = b - a
        linear = n * self._linear_flops_per_token
        # token t attends to t+1 positions (itself and its prefix): sum over t in [a, b)
        ctx = (a + b + 1) * n / 2
        attn = self._attn_flops_per_context_token * ctx
        return float(linear + attn)


def from_hf_config(cfg: dict, name: str = "served") -> ModelCostConfig:
    """The cost model of a served Kimi-Linear-style model, from its HF ``config.json`` fields
    (``linear_attn_config`` lists the 1-based KDA layers), so eviction prices the actual model."""
    la = cfg.get("linear_attn_config") or {}
    n_layers = int(cfg["num_hidden_layers"])
    n_kda = len(la.get("kda_layers") or [])
    head_dim = int(la.get("head_dim", 0))
    heads = int(cfg.get("num_attention_heads", 0))
    return ModelCostConfig(
        name=name,
        hidden=int(cfg["hidden_size"]),
        vocab=int(cfg.get("vocab_size", 0)),
        num_kda_layers=n_kda,
        kda_heads=int(la.get("num_heads", 0)),
        kda_head_k=head_dim,
        kda_head_v=head_dim,
        kda_conv_kernel=int(la.get("short_conv_kernel_size", 4)),
        num_mla_layers=n_layers - n_kda,
        mla_heads=heads,
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        num_experts=int(cfg.get("num_experts") or 0),
        top_k=int(cfg.get("num_experts_per_token") or cfg.get("num_experts_per_tok") or 0),
        moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
        num_shared_experts=int(cfg.get("num_shared_experts") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0) if cfg.get("num_experts") else n_layers,
        dense_intermediate=int(cfg.get("intermediate_size") or 0),
    )


PRESETS: dict[str, ModelCostConfig] = {
    "tiny": ModelCostConfig(
        name="tiny",
        hidden=256,
        vocab=1024,
        num_kda_layers=6,
        kda_heads=4,
        kda_head_k=64,
        kda_head_v=64,
        kda_conv_kernel=4,
        num_mla_layers=2,
        mla_heads=4,
        kv_lora_rank=128,
        qk_rope_dim=32,
        qk_nope_dim=64,
        v_head_dim=64,
        q_lora_rank=0,
        num_experts=8,
        top_k=2,
        moe_intermediate=256,
        num_shared_experts=1,
        first_k_dense=1,
        dense_intermediate=512,
    ),
    "kimi-linear-48b": ModelCostConfig(
        name="kimi-linear-48b",
        hidden=2304,
        vocab=163840,
        num_kda_layers=20,
        kda_heads=32,
        kda_head_k=128,
        kda_head_v=128,
        kda_conv_kernel=4,
        num_mla_layers=7,
        mla_heads=32,
        kv_lora_rank=512,
        qk_rope_dim=64,
        qk_nope_dim=128,
        v_head_dim=128,
        q_lora_rank=0,
        num_experts=256,
        top_k=8,
        moe_intermediate=1024,
        num_shared_experts=1,
        first_k_dense=1,
        dense_intermediate=9216,
    ),
    "k3": ModelCostConfig(
        name="k3",
        hidden=7168,
        vocab=163840,
        num_kda_layers=69,
        kda_heads=64,
        kda_head_k=128,
        kda_head_v=128,
        kda_conv_kernel=4,
        num_mla_layers=24,
        mla_heads=128,
        kv_lora_rank=512,
        qk_rope_dim=64,
        qk_nope_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
        num_experts=896,
        top_k=16,
        moe_intermediate=2048,
        num_shared_experts=1,
        first_k_dense=1,
        dense_intermediate=18432,
    ),
}


def preset(name: str) -> ModelCostConfig:
    return PRESETS[name]
