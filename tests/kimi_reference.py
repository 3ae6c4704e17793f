"""A plain-torch forward of the Kimi Linear architecture, written from the checkpoint for the tests.

It does not import SGLang: it reads ``config.json`` and ``model.safetensors`` and runs the
architecture (KDA with short conv and gated norm, MLA without RoPE, sigmoid-routed MoE with a
shared expert) in fp32, full sequence at once. The KDA recurrence is fla's pure-torch
``naive_recurrent_kda``. This is the oracle the server's logits and greedy tokens are checked against.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class KimiLinearReference:
    def __init__(self, model_dir: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = load_file(os.path.join(model_dir, "model.safetensors"))
        la = self.cfg["linear_attn_config"]
        self.kda_layers = {i - 1 for i in la["kda_layers"]}
        self.eps = self.cfg["rms_norm_eps"]

    def _kda(self, p: str, x: torch.Tensor) -> torch.Tensor:
        from fla.ops.kda.naive import naive_recurrent_kda

        w, la = self.w, self.cfg["linear_attn_config"]
        H, D, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        T = x.shape[0]
        qkv = torch.cat([x @ w[f"{p}.{n}_proj.weight"].T for n in "qkv"], -1)  # [T, 3HD]
        conv_w = torch.cat([w[f"{p}.{n}_conv1d.weight"] for n in "qkv"], 0)  # [3HD, 1, K]
        qkv = F.conv1d(qkv.T.unsqueeze(0), conv_w, padding=K - 1, groups=conv_w.shape[0])[0, :, :T].T
        qkv = F.silu(qkv)
        q, k, v = (t.reshape(T, H, D) for t in qkv.split(H * D, -1))
        q, k = F.normalize(q, p=2, dim=-1, eps=1e-6), F.normalize(k, p=2, dim=-1, eps=1e-6)
        f = (x @ w[f"{p}.f_a_proj.weight"].T) @ w[f"{p}.f_b_proj.weight"].T + w[f"{p}.dt_bias"]
        g = -torch.exp(w[f"{p}.A_log"].reshape(1, H, 1)) * F.softplus(f.reshape(T, H, D))
        beta = torch.sigmoid(x @ w[f"{p}.b_proj.weight"].T)  # [T, H]
        o, _ = naive_recurrent_kda(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g.unsqueeze(0),
            beta.unsqueeze(0),
            scale=D**-0.5,
            output_final_state=False,
        )
        o = o[0]  # [T, H, D]
        gate = ((x @ w[f"{p}.g_a_proj.weight"].T) @ w[f"{p}.g_b_proj.weight"].T).reshape(T, H, D)
        o = _rms(o, w[f"{p}.o_norm.weight"], self.eps) * torch.sigmoid(gate)
        return o.reshape(T, H * D) @ w[f"{p}.o_proj.weight"].T

    def _mla(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, c = self.w, self.cfg
        H, nope, rope, vd, r = (
            c["num_attention_heads"],
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
            c["kv_lora_rank"],
        )
        T = x.shape[0]
        q = (x @ w[f"{p}.q_proj.weight"].T).reshape(T, H, nope + rope)
        ckv = x @ w[f"{p}.kv_a_proj_with_mqa.weight"].T
        latent, k_rot = ckv[:, :r], ckv[:, r:]
        latent = _rms(latent, w[f"{p}.kv_a_layernorm.weight"], self.eps)
        kv = (latent @ w[f"{p}.kv_b_proj.weight"].T).reshape(T, H, nope + vd)
        k = torch.cat([kv[..., :nope], k_rot.unsqueeze(1).expand(T, H, rope)], -1)
        v = kv[..., nope:]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=(nope + rope) ** -0.5,
        ).transpose(0, 1)
        return o.reshape(T, H * vd) @ w[f"{p}.o_proj.weight"].T

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate, up, down = (w[f"{p}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, c = self.w, self.cfg
        scores = torch.sigmoid(x @ w[f"{p}.gate.weight"].T)
        idx = torch.topk(scores + w[f"{p}.gate.e_score_correction_bias"], c["num_experts_per_token"], -1).indices
        wt = scores.gather(1, idx)
        if c.get("moe_renormalize", True):
            wt = wt / wt.sum(-1, keepdim=True)
        wt = wt * c["routed_scaling_factor"]
        out = torch.zeros_like(x)
        for e in range(c["num_experts"]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            h = F.silu(xe @ w[f"{p}.experts.{e}.w1.weight"].T) * (xe @ w[f"{p}.experts.{e}.w3.weight"].T)
            out.index_add_(0, tok, (h @ w[f"{p}.experts.{e}.w2.weight"].T) * wt[tok, slot, None])
        return out + self._mlp(f"{p}.shared_experts", x)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of ``ids``."""
        w, c = self.w, self.cfg
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = _rms(x, w[f"{p}.input_layernorm.weight"], self.eps)
            x = x + (self._kda(f"{p}.self_attn", h) if i in self.kda_layers else self._mla(f"{p}.self_attn", h))
            h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], self.eps)
            dense = i < c["first_k_dense_replace"]
            x = x + (self._mlp(f"{p}.mlp", h) if dense else self._moe(f"{p}.block_sparse_moe", h))
        return _rms(x, w["model.norm.weight"], self.eps) @ w["lm_head.weight"].T

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = list(ids)
        for _ in range(n):
            out.append(int(self.logits(out)[-1].argmax()))
        return out[len(ids) :]
