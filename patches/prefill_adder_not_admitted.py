"""Tell the k3 cache when the prefill loop matched a request and then did not admit it.

``Scheduler._get_new_batch_prefill_raw`` (``managers/scheduler.py``) matches each waiting request
(``init_next_round_input``, which calls the cache's ``match_prefix`` with ``cow_mamba``) and then
asks ``PrefillAdder.add_one_req`` (``managers/schedule_policy.py``) whether it fits. When it does
not, the loop stops, frees the request's fresh state slot and clears its staged copy-on-write, and
tells the cache nothing: upstream's caches hold nothing for a request until the adder commits it
(``req.lock = self.tree_cache.lock(req.last_node)`` in ``_commit_prefill_admission``). The k3
cache pins a hit at the match, because its copy out of the checkpoint runs at the request's first
forward (``sglang_k3/integration/k3_cache.py``, "Hit (copy-on-write)"). A pin that outlives a
rejection locks its path's KV and its checkpoint while the batch admitted before it allocates:
that batch was checked against memory that was free or evictable before the match, so its
``alloc_for_extend`` could come up short and the scheduler would crash with "Out of memory"
(seen under ``benchmarks.live_ab --pressure``). Its queued INT8 restore would also write a state
slot SGLang had just freed.

Around ``add_one_req``: after upstream's own decision, a request that is not the adder's last
admitted one is handed to ``K3RadixCache.match_not_admitted``, the same test upstream's loop uses
(``req is adder.can_run_list[-1]``). With another cache, nothing changes.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
REASON = "the k3 cache pins a hit at match; a request the adder refuses must drop that pin before the batch allocates"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def release_not_admitted(original, self, req, *args, **kwargs):
    result = original(self, req, *args, **kwargs)
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(self.tree_cache)
    if verbs is not None and not (self.can_run_list and self.can_run_list[-1] is req):
        verbs.not_admitted(req)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, release_not_admitted, HookType.AROUND)
