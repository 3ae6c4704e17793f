"""What SGLang's prefill adder admits with the k3 cache: no batch past the state slots it can have,
and a matched request it does not admit drops what its match holds.

**State slots.** ``Scheduler._get_new_batch_prefill_raw`` (``managers/scheduler.py``) fills a
prefill batch through ``PrefillAdder.add_one_req`` (``managers/schedule_policy.py``), which counts
request rows and KV tokens. Each admitted request that holds no KDA state slot takes one at
``alloc_req_slots`` (``mem_cache/allocation.py``), after asking the cache to evict for it, and
SGLang *asserts* when none is left ("Not enough space for mamba cache", which stops the server).
Upstream gates admission on state slots only for its own shared state pool (``rem_mamba_slots``,
set when the KV allocator is ``UnifiedMambaTokenToKVPoolAllocator``). Under k3's unified memory a
state slot is a run of whole blocks: the region's (shared with checkpoints, which go by value when
a state needs the slot) or, beyond it, free memory. When the region's last free slot is borrowed by
a checkpoint that cannot go yet (a hit being restored, a copy not landed) and KV fragments the rest,
there are fewer slots than rows: on an H100 under the live A/B's pressure budget (page 1, 8 slots,
16 rows) a batch of four was admitted with one slot to be had, and the server stopped
(``benchmarks/GPU_NOTES.md``, tenth session). So before upstream's decision the request is asked
for: the slots the batch needs so far (its admitted requests without one, plus this one if it has
none) must be free, or be freed now by eviction (``SchedulerVerbs.states_ready``); otherwise the
adder answers ``NO_TOKEN``, as it does when KV is short, and the request waits for a running one
to finish. A request whose hit already took a slot at the match asks too, for the slots it must
leave to those admitted before it.

**Matched, not admitted.** The loop matches each waiting request (``init_next_round_input``, the
cache's ``match_prefix`` with ``cow_mamba``) before the adder decides. When the adder refuses it,
the loop stops, frees the request's fresh state slot and clears its staged copy-on-write, and tells
the cache nothing: upstream's caches hold nothing for a request until the adder commits it
(``req.lock = self.tree_cache.lock(req.last_node)`` in ``_commit_prefill_admission``). The k3 cache
pins a hit at the match, because its copy out of the checkpoint runs at the request's first
forward (``sglang_k3/integration/k3_cache.py``, "Hit (copy-on-write)"). A pin that outlives a
rejection locks its path's KV and its checkpoint while the batch admitted before it allocates: that
batch was checked against memory that was free or evictable before the match, so its
``alloc_for_extend`` could come up short and the scheduler would crash with "Out of memory" (seen
under ``benchmarks.live_ab --pressure``). Its queued INT8 restore would also write a state slot
SGLang had just freed. So after the decision a request that is not the adder's last admitted one
is handed to ``K3RadixCache.match_not_admitted``, the same test upstream's loop uses
(``req is adder.can_run_list[-1]``).

With another cache, nothing changes.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
REASON = (
    "the k3 cache's state slots are whole blocks that SGLang's row count does not see; and it pins a hit at "
    "match, which a request the adder refuses must drop before the batch allocates"
)
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def _states_needed(adder, req) -> int:
    """State slots the batch will take at allocation if ``req`` joins it."""
    return sum(1 for r in adder.can_run_list if not r.kv.holds_mamba) + (not req.kv.holds_mamba)


def admit_within_state_slots(original, self, req, *args, **kwargs):
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(self.tree_cache)
    if verbs is None:
        return original(self, req, *args, **kwargs)
    need = _states_needed(self, req)
    if need and not verbs.states_ready(need):
        from sglang.srt.managers.schedule_policy import AddReqResult

        result = AddReqResult.NO_TOKEN
    else:
        result = original(self, req, *args, **kwargs)
    if not (self.can_run_list and self.can_run_list[-1] is req):
        verbs.not_admitted(req)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, admit_within_state_slots, HookType.AROUND)
