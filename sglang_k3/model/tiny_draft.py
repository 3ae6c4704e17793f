"""A random-weight EAGLE or EAGLE3 draft model for a K3 model directory (issue #34).

    python -m sglang_k3.model.tiny_draft --target DIR --out DRAFT --kind eagle3 [--dtype bfloat16]

Writes ``config.json`` and ``model.safetensors`` shaped as SGLang 0.5.23's draft classes load them
(``models/llama_eagle.py``: ``LlamaForCausalLMEagle``; ``models/llama_eagle3.py``:
``LlamaForCausalLMEagle3``), one decoder layer, for the target in ``DIR`` (its ``config.json``:
hidden size, vocabulary, layers, special tokens):

* ``eagle``: ``fc`` (embedding and the target's last hidden state, ``2H -> H``, with bias), layer 0
  without ``input_layernorm``, no final norm. The embedding and the LM head are the target's
  (``set_embed_and_head``), so the file has neither.
* ``eagle3``: ``fc`` from the target's aux hidden states (``len(layer_ids) * H -> H``), layer 0
  whose ``q/k/v`` take ``2H`` (embedding and ``fc``'s output), ``hidden_norm``, a final ``norm``,
  and its own ``lm_head`` over the whole vocabulary (``draft_vocab_size`` = ``vocab_size``, no
  ``d2t``); the embedding is the target's (``set_embed``: same hidden size). The aux layers are
  written into ``eagle_config.eagle_aux_hidden_state_layer_ids``: Llama's default for the target's
  depth, in the convention ``patches/kimi_linear_eagle`` reads (the layers whose output is taken).

The draft's hidden size is the target's (EAGLE concatenates the two), and ``torch_dtype`` is the
target's unless ``--dtype`` says otherwise (the draft's ``fc`` takes the target's hidden states:
serve both in one dtype, ``--dtype``). Weights are seeded and stored in fp32 (SGLang casts them
at load); a random draft is rarely accepted: it exercises the path, it does not speed it up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

KINDS = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}
DTYPES = ("float32", "bfloat16", "float16")


def aux_layer_ids(num_layers: int) -> list[int]:
    """Llama's default EAGLE3 capture for a target of ``num_layers`` layers, as the layers whose
    output is taken (distinct and in range: a shallow target gets fewer)."""
    from sglang_k3.patches.kimi_linear_eagle import default_layer_ids

    return sorted({i for i in default_layer_ids(num_layers) if 0 <= i < num_layers})


def draft_config(target: dict, kind: str, dtype: str | None = None) -> dict:
    """The draft's ``config.json`` for a target whose ``config.json`` is ``target``."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose from {', '.join(KINDS)}")
    hidden = int(target["hidden_size"])
    head_dim = 64 if hidden < 512 else 128
    if hidden % head_dim:
        raise ValueError(f"target hidden size {hidden} is not a multiple of the draft's head dim {head_dim}")
    cfg = {
        "architectures": [KINDS[kind]],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": hidden // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(target.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(target.get("max_position_embeddings", 16384)),
        "vocab_size": int(target["vocab_size"]),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype or target.get("torch_dtype", "float32"),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in target:
            cfg[key] = target[key]
    if kind == "eagle3":
        cfg["draft_vocab_size"] = cfg["vocab_size"]
        cfg["target_hidden_size"] = hidden
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": aux_layer_ids(int(target["num_hidden_layers"])),
            "use_aux_hidden_state": True,
        }
    return cfg


def draft_weights(cfg: dict, seed: int = 0) -> dict:
    """Seeded random weights under the names the draft class's ``load_weights`` takes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    eagle3 = cfg["architectures"] == [KINDS["eagle3"]]
    attn_in = 2 * h if eagle3 else h

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    layer = "layers.0."
    w = {
        layer + "self_attn.q_proj.weight": rand(q, attn_in),
        layer + "self_attn.k_proj.weight": rand(kv, attn_in),
        layer + "self_attn.v_proj.weight": rand(kv, attn_in),
        layer + "self_attn.o_proj.weight": rand(h, q),
        layer + "mlp.gate_proj.weight": rand(inter, h),
        layer + "mlp.up_proj.weight": rand(inter, h),
        layer + "mlp.down_proj.weight": rand(h, inter),
        layer + "post_attention_layernorm.weight": torch.ones(h),
    }
    if eagle3:
        n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        w["fc.weight"] = rand(h, cfg["target_hidden_size"] * n_aux)
        w[layer + "input_layernorm.weight"] = torch.ones(h)
        w[layer + "hidden_norm.weight"] = torch.ones(h)
        w["norm.weight"] = torch.ones(h)
        w["lm_head.weight"] = rand(cfg["draft_vocab_size"], h)
    else:
        w["fc.weight"] = rand(h, 2 * h)
        w["fc.bias"] = rand(h)
    return {k: v.contiguous() for k, v in w.items()}


def build_draft(target_dir: str, out_dir: str, kind: str, dtype: str | None = None, seed: int = 0) -> str:
    """Write the draft for the model in ``target_dir`` into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = draft_config(json.load(f), kind, dtype)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(draft_weights(cfg, seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def fit_followers(draft_dir: str, target_dir: str, followers: dict[int, int]) -> float:
    """Make the EAGLE draft in ``draft_dir`` propose, after token ``x``, ``followers[x]``: the
    token the target's own greedy answers most often put after ``x`` (a bigram of the target,
    counted from answers the caller collected). A random draft is almost never accepted, so the
    verify's accept path (states after accepted drafts, the draft's extend over them) would go
    untested; with this draft, drafts are accepted where the target follows its commonest bigram.

    The draft's layer is silenced (``o_proj`` and ``down_proj`` zero: the residual carries ``fc``'s
    output through) and ``fc`` ignores the target's hidden state: the draft's hidden state is
    ``A e_x``, ``e_x`` the target's embedding of ``x``, and its logits ``W A e_x`` through the
    target's LM head ``W`` (the draft shares both). ``A`` is the least-squares fit of those
    logits to a margin-scaled one-hot of each follower. Returns the share of ``followers`` the
    fitted draft ranks first."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with open(os.path.join(draft_dir, "config.json")) as f:
        if json.load(f)["architectures"] != [KINDS["eagle"]]:
            raise ValueError("fit_followers fits an EAGLE draft (LlamaForCausalLMEagle), not EAGLE3")
    with safe_open(os.path.join(target_dir, "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float()
    xs = sorted(followers)
    if not xs:
        raise ValueError("no followers to fit")
    h = embed.shape[1]
    targets = torch.full((head.shape[0], len(xs)), -1.0)
    targets[[followers[x] for x in xs], range(len(xs))] = 10.0
    inputs = embed[xs].T  # h x n
    # W A E = T: A = pinv(W) T pinv(E)
    a = torch.linalg.pinv(head) @ targets @ torch.linalg.pinv(inputs)
    path = os.path.join(draft_dir, "model.safetensors")
    w = load_file(path)
    w["fc.weight"] = torch.cat([a, torch.zeros(h, w["fc.weight"].shape[1] - h)], dim=1).contiguous()
    w["fc.bias"] = torch.zeros(h)
    w["layers.0.self_attn.o_proj.weight"] = torch.zeros_like(w["layers.0.self_attn.o_proj.weight"])
    w["layers.0.mlp.down_proj.weight"] = torch.zeros_like(w["layers.0.mlp.down_proj.weight"])
    save_file(w, path, metadata={"format": "pt"})
    ranked = (head @ (a @ inputs)).argmax(dim=0).tolist()
    return sum(r == followers[x] for r, x in zip(ranked, xs)) / len(xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_k3.model.tiny_draft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="the target model's directory (its config.json is read)")
    p.add_argument("--out", required=True, help="output directory (created; files are overwritten)")
    p.add_argument("--kind", choices=tuple(KINDS), default="eagle3", help="draft class (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="torch_dtype of config.json (default: the target's)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    a = p.parse_args(argv)
    print(build_draft(a.target, a.out, a.kind, a.dtype, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
