"""Leave a waiting request out of admission while the k3 cache copies its prefix up from Mooncake.

With lower tiers, the k3 cache brings a request's deepest boundary back onto the device when the
request is admitted (``TierBridge.promote``, inside the admitting ``match_prefix``). Where only
Mooncake holds that boundary, the promotion's reads went over the network on the scheduler's
thread, one object after another (about 1 GB/s over TCP on loopback), while every other request
waited on that thread. The cache can copy the boundary into its host tier on a thread of its own
(the prefetch), but admission did not wait for the copy, so it was usually still running.

SGLang's own answer for HiCache's storage tier is the same shape: ``_get_new_batch_prefill_raw``
(``managers/scheduler.py``) skips a waiting request whose prefetch is not done
(``tree_cache.check_prefetch_progress``), but only when ``enable_hicache_storage`` or
``enable_lmcache`` is set, flags that switch on HiCache's other paths as well.

Around ``_get_new_batch_prefill_raw``: of the first waiting requests, as many as the call could
admit (``get_num_allocatable_reqs``, the loop's own bound), those the k3 cache holds back
(``SchedulerVerbs.held_back``: their copy up runs, for at most 10 s) are taken out of
``waiting_queue`` for the call and put back after it in their places, so the others are admitted
meanwhile; the held request is admitted at a later call, once its boundary is in host memory.
When that leaves the call nothing to admit and nothing runs, the scheduler would go straight to its
next iteration and spin, taking the GIL from the prefetch thread doing the copy at every switch
interval (SGLang's ``on_idle`` yields the GIL only for its own storage tiers, ``time.sleep(0)``
under ``enable_hicache_storage``); so it waits there until a copy lands, at most 5 ms
(``SchedulerVerbs.idle_while_held``).
With another cache, or no lower tier, nothing changes.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"
REASON = "admit a waiting request only once its prefix is copied up from Mooncake, off the scheduler's thread"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def hold_tier_loads(original, self, *args, **kwargs):
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(self.tree_cache)
    queue = self.waiting_queue
    held = []
    if verbs is not None and queue and verbs.may_hold():
        running = kwargs.get("running_batch") or self.running_batch
        # the free request rows, as the loop counts them: the cache looks only at as many
        room = self.get_num_allocatable_reqs(len(running.reqs), running_batch=running)
        held = verbs.held_back(queue, room)
    if not held:
        return original(self, *args, **kwargs)
    held_ids = {id(r) for r in held}
    self.waiting_queue = [r for r in queue if id(r) not in held_ids]
    try:
        out = original(self, *args, **kwargs)  # (the new batch or None, the running batch)
        if out[0] is None and out[1].is_empty():
            verbs.idle_while_held()
        return out
    finally:
        # the call removed the requests it admitted and may have appended some (retracted,
        # grammar-ready): keep the order the queue had, then what was appended
        left = self.waiting_queue
        left_ids = {id(r) for r in left}
        queue_ids = {id(r) for r in queue}
        self.waiting_queue = [r for r in queue if id(r) in held_ids or id(r) in left_ids] + [
            r for r in left if id(r) not in queue_ids
        ]


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, hold_tier_loads, HookType.AROUND)
