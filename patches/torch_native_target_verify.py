"""MLA attention for a speculative verify under ``torch_native`` (the CPU platform's backend).

``TorchNativeAttnBackend.forward_extend`` attends each request's extend tokens over
``extend_prefix_lens`` / ``extend_seq_lens`` / ``seq_lens`` of the batch. A ``TARGET_VERIFY``
batch (NGRAM's drafts) sets none of those for its draft tokens: ``seq_lens`` is the verified
length, the ``draft_token_num`` drafts of each request follow it (their KV written at
``out_cache_loc``), and upstream's GPU backends read the layout from ``spec_info`` instead. For a
draft chain (``--speculative-ngram-max-bfs-breadth 1``, made a chain by
``patches/ngram_chain_drafts``) this hook attends each request's drafts itself: written to their KV
slots as the extend writes them, each draft over the verified prefix and the drafts up to it (the
extend's own loop would attend a query the length of the whole sequence, ``seq_len`` squared per
request). A draft tree would need its mask: refused.
"""

from __future__ import annotations

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
REASON = "torch_native's extend reads extend lengths a TARGET_VERIFY batch does not set (it reads spec_info)"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def forward_extend_verify(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original_fn(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    import torch
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from torch.nn.functional import scaled_dot_product_attention

    spec = forward_batch.spec_info
    if getattr(spec, "ragged_verify_layout", None) is not None:
        raise NotImplementedError("ragged speculative verify under torch_native attention")
    bs = forward_batch.batch_size
    sib = getattr(spec, "retrieve_next_sibling", None)
    if sib is not None and bool((sib[:bs] >= 0).any()):
        raise NotImplementedError(
            "a speculative draft tree (a node with siblings) under torch_native attention: the CPU path "
            "verifies draft chains only (--speculative-ngram-max-bfs-breadth 1, patches/ngram_chain_drafts)"
        )
    if layer.is_cross_attention or (getattr(layer, "sliding_window_size", None) or -1) > -1:
        raise NotImplementedError("speculative verify of a cross-attention or sliding-window layer on CPU")
    d = int(spec.draft_token_num)
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
        )
    k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
    heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
    qh = q.view(-1, heads, layer.qk_head_dim)
    out = q.new_empty((qh.shape[0], heads * v_dim))
    o = out.view(-1, heads, v_dim)
    causal = torch.ones(d, d, dtype=torch.bool).tril()
    rows = forward_batch.req_pool_indices.tolist()
    for i, (row, n) in enumerate(zip(rows, forward_batch.seq_lens.tolist())):
        # the verified prefix (n tokens) and the drafts; draft t sees the prefix and drafts <= t
        locs = self.req_to_token_pool.req_to_token[row, : n + d]
        key, val = k_cache[locs].movedim(0, -2), v_cache[locs].movedim(0, -2)  # [heads_kv, n + d, dim]
        query = qh[i * d : (i + 1) * d].movedim(0, -2)  # [heads, d, dim]
        mask = torch.cat([torch.ones(d, n, dtype=torch.bool), causal], dim=1)
        o[i * d : (i + 1) * d] = (
            scaled_dot_product_attention(
                query.unsqueeze(0),
                key.to(query.dtype).unsqueeze(0),
                val.to(query.dtype).unsqueeze(0),
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            .squeeze(0)
            .movedim(-2, 0)
        )
    return out


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, forward_extend_verify, HookType.AROUND)
