"""Record, on the request, what the k3 cache's admitting lookup found.

``match_kv_cache`` is where SGLang passes a request to the cache's ``match_prefix`` and adopts
the result; it keeps only ``device_prefix_len`` (which becomes ``cached_tokens``). The restore
boundary, the replayed tokens (KV in the tree, recomputed because the nearest checkpoint was
earlier) and the KV match length come from the tree's record of that very lookup and are set on
the ``Req`` as ``k3_match`` for the output streamer (``meta_info``). Only the match that admits
a request (``cow_mamba=True``) is recorded; scheduling-policy probes are not.
"""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.common.match_kv_cache"
REASON = "per-request restore boundary and replayed tokens are not carried by upstream's MatchResult handling"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def record_k3_match(original, req, tree_cache, *args, **kwargs):
    if not kwargs.get("cow_mamba"):
        return original(req, tree_cache, *args, **kwargs)
    from sglang_k3.integration import observability as obs
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(tree_cache)
    if verbs is None:
        return original(req, tree_cache, *args, **kwargs)
    before = verbs.lookups()
    result = original(req, tree_cache, *args, **kwargs)
    obs.record_match(req, verbs.cache, before, result)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, record_k3_match, HookType.AROUND)
