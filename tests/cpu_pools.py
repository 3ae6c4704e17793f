"""Real SGLang pools on the CPU, small, for tests that build the cache's state layer directly."""

from __future__ import annotations


def hybrid_pool(
    layers,
    *,
    heads: int,
    head_dim: int,
    conv_kernel: int,
    mamba_size: int = 12,
    size: int = 4,
    max_context_len: int = 64,
):
    """A ``HybridReqToTokenPool`` (request rows + the KDA mamba pool) for the KDA layer ids
    ``layers``, as SGLang builds it for a Kimi-Linear model under ``no_buffer``."""
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    shape = KimiLinearStateShape.create(
        tp_world_size=1, num_heads=heads, head_dim=head_dim, conv_kernel_size=conv_kernel
    )
    params = KimiLinearCacheParams(shape=shape, layers=list(layers))
    return HybridReqToTokenPool(
        size=size,
        mamba_size=mamba_size,
        mamba_spec_state_size=0,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=list(layers),
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )


def k3_cache_on_cpu(cfg, layers=(0, 2, 3)):
    """The server's ``K3RadixCache``, built as SGLang's registry builds it, on small CPU pools."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_k3.integration.k3_cache import K3RadixCache

    rtp = hybrid_pool(list(layers), heads=2, head_dim=16, conv_kernel=4)
    alloc = TokenToKVPoolAllocator(size=64, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1)
    return K3RadixCache(params, cfg)


def mla_kv_pool_and_allocator(rtp, *, kv_tokens: int, page: int = 1, mla_layers=(1,)):
    """SGLang's ``HybridLinearKVPool`` (MLA KV for ``mla_layers``, the KDA states of ``rtp``'s
    mamba pool) and its token allocator (its paged one at ``page`` over 1), small, on the CPU."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    kv = HybridLinearKVPool(
        size=kv_tokens,
        dtype=torch.float32,
        page_size=page,
        head_num=1,
        head_dim=48,
        full_attention_layer_ids=list(mla_layers),
        device="cpu",
        mamba_pool=rtp.mamba_pool,
        use_mla=True,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
    )
    if page == 1:
        alloc = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(
            size=kv_tokens, page_size=page, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False
        )
    return kv, alloc


def unified_k3_cache_on_cpu(
    cfg, layers=(0, 2, 3), *, kv_tokens: int = 96, mamba_size: int = 6, rows: int = 4, page: int = 1
):
    """The server's ``K3RadixCache`` over the unified budget, built as the server builds it: real
    SGLang KV and state pools (and its paged allocator at ``page`` over 1), then
    :func:`sglang_k3.integration.unified_memory.install`. Returns ``(cache, kv_pool, allocator)``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_k3.integration.k3_cache import K3RadixCache
    from sglang_k3.integration.unified_memory import install

    rtp = hybrid_pool(list(layers), heads=2, head_dim=16, conv_kernel=4, mamba_size=mamba_size, size=rows)
    kv, alloc = mla_kv_pool_and_allocator(rtp, kv_tokens=kv_tokens, page=page)
    alloc = install(cfg, rtp, kv, alloc)
    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page)
    return K3RadixCache(params, cfg), kv, alloc
