"""Put MLA KV, active KDA states and k3 checkpoints in one byte budget (sglang-k3's unified memory).

SGLang 0.5.23 builds the KV pool, the state pool and their allocators in
``KVCacheConfigurator._init_pools``. Its own ``--enable-unified-memory`` replaces that path but
refuses out-of-tree platforms (``reject_out_of_tree_path``: our CPU platform) and knows nothing of
k3 checkpoints, and no registry offers a pool factory for hybrid KDA models (the platform's
``get_kv_pool_cls`` picks the KV pool class only). So an after-hook takes what SGLang built and,
when the k3 cache will run with unified memory, rebuilds the two pools over one buffer and swaps
in the unified allocators (:func:`sglang_k3.integration.unified_memory.install`). It runs before
any attention backend reads a pool, in every TP worker, on the target model only. With a draft
model (EAGLE / EAGLE3) the pools stay SGLang's: the draft's KV pool is sized from the target's
fixed pool and shares its allocator, whose unified ids would run past it (``launch_server`` turns
unified memory off for them and says so; this covers the other entry points).
"""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools"
REASON = "no registry builds the KV and state pools of a hybrid model; k3 puts them in one budget"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def wanted(server_args, cfg) -> bool:
    from sglang_k3.integration.k3_args import DRAFT_MODEL_ALGORITHMS

    return (
        cfg.unified_memory
        and getattr(server_args, "radix_cache_backend", None) == "k3"
        and not getattr(server_args, "disable_radix_cache", False)
        and str(getattr(server_args, "speculative_algorithm", None) or "").upper() not in DRAFT_MODEL_ALGORITHMS
    )


def unify_pools(result, self, *args, **kwargs):
    import msgspec
    from sglang.srt.runtime_context import get_server_args

    from sglang_k3.config import from_env

    if result is None or getattr(self, "is_draft_worker", False):
        return result
    cfg = from_env()
    if not wanted(get_server_args(), cfg):
        return result
    from sglang_k3.integration.unified_memory import install

    alloc = install(cfg, result.req_to_token_pool, result.token_to_kv_pool, result.token_to_kv_pool_allocator)
    if alloc is None:
        return result
    return msgspec.structs.replace(result, token_to_kv_pool_allocator=alloc)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, unify_pools, HookType.AFTER)
