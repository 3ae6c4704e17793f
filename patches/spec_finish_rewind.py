"""Cache the turn of a request that stopped inside a speculative verify's accepted tokens.

SGLang's decode result processor refuses to cache a finished request whose committed KV runs past
its stop (``_mamba_can_cache_finished_req``: ``owned_kv_len != kv_committed_len``; a verify commits
a whole accepted run, and a stop token or ``max_new_tokens`` can fall inside it), because the live
state is the one after the whole run and "cannot be shortened with the key". The request then
inserts nothing (``skip_radix_cache_insert``), and the next turn recomputes the whole previous
answer. With the k3 cache the state at the stop is still in the verify's per-token scratch: this
hook asks the cache to set the slot back to it (``SchedulerVerbs.speculative_stop``) and lets the
turn be cached as without speculation. SGLang's own cache, or the k3 cache when it cannot (a draft
tree, the overlap scheduler), keep upstream's answer.
"""

from __future__ import annotations

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._mamba_can_cache_finished_req"
)
REASON = "a request that stops inside a verify's accepted tokens inserts nothing; k3 can set its state to the stop"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def can_cache_finished(original_fn, self, req, result, i):
    ok = original_fn(self, req, result, i)
    if ok:
        return ok
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(getattr(self, "tree_cache", None))
    accepted = getattr(result, "accept_lens", None)
    retained = getattr(result, "grammar_retained_tokens", None)
    if verbs is None or accepted is None or (retained is not None and retained[i] is not None):
        return ok
    return verbs.speculative_stop(req, i, int(accepted[i]))


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, can_cache_finished, HookType.AROUND)
