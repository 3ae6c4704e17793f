"""Observability of the ``k3`` cache: a ``/server_info`` entry, Prometheus series, per-request fields.

Everything here runs in the scheduler process and reads the cache from outside, as the scheduler
holds it (``scheduler.tree_cache``); :class:`~sglang_k3.integration.k3_cache.K3RadixCache` is not
changed. The upstream symbols it is wired to are hooked in ``patches/`` (one module each):

* ``SchedulerInternalStateController.get_internal_state`` (after): adds :data:`SERVER_INFO_KEY`
  to the scheduler's internal state, which ``GET /server_info`` returns per DP rank under
  ``internal_states``. (``scheduler_info``, the other source of ``/server_info``, is a snapshot
  taken at startup.)
* ``Scheduler.process_batch_result`` (after): refreshes the ``sglang_k3_*`` Prometheus series
  when ``--enable-metrics`` is on. Every cache event (match, checkpoint, eviction, release)
  happens while a batch is scheduled or its result processed, so the series are current once
  the iteration that served a request is over. They are written to prometheus_client's
  multiprocess directory, which SGLang's ``/metrics`` collects.
* ``mem_cache.common.match_kv_cache`` (around): after the match that admits a request
  (``cow_mamba=True``), records on the ``Req`` the restore boundary, the replayed tokens and
  the KV match length of that lookup, read from the tree's own match record.
* ``Scheduler.get_output_streamer_class`` (after): selects a ``SchedulerOutputStreamer``
  subclass that returns those three numbers through upstream's ``customized_info`` channel
  (``build_additional_customized_info``), which the tokenizer manager merges into
  ``meta_info``. Nothing is copied from upstream.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

logger = logging.getLogger(__name__)

SERVER_INFO_KEY = "k3_cache"

# Per-request ``meta_info`` keys. Upstream's customized_info channel accumulates lists, so each
# is a one-element list ``[n]`` (the admitting match of the request).
META_RESTORE_LEN = "k3_restore_len"
META_REPLAYED_TOKENS = "k3_replayed_tokens"
META_KV_MATCH_LEN = "k3_kv_match_len"
META_KEYS = (META_RESTORE_LEN, META_REPLAYED_TOKENS, META_KV_MATCH_LEN)

# Attributes set on SGLang's ``Req`` (namespaced so they cannot collide with upstream's).
REQ_MATCH_ATTR = "k3_match"
REQ_SENT_ATTR = "k3_match_sent"

METRIC_PREFIX = "sglang_k3_"
# sglang_k3.cache.ghosts.StateClass, as the metrics name them
REUSE_CLASSES = {
    "turn": "generation-end state",
    "chunk": "prefill chunk-end state",
    "prompt": "prompt-end state",
    "decode": "decode-interval state",
    "old_turn": "generation-end state a later turn went past",
}
# stats field -> documentation. Gauges are levels; counters are lifetime totals (they survive
# /flush_cache, which empties the tree but not the counts) and get prometheus' ``_total``.
GAUGES: dict[str, str] = {
    "token_hit_rate": "Restored tokens over looked-up tokens, since start.",
    "checkpoint_count": "Live KDA state checkpoints in the k3 tree.",
    "checkpoint_bytes": "Bytes held by live checkpoints.",
    "checkpoint_slot_bytes": "Bytes of one checkpoint (all KDA layers of one boundary).",
    "kv_tokens": "MLA KV tokens held by the k3 tree.",
    "export_stash_bytes": "Bytes of exported chunk-boundary state rows held until their requests checkpoint.",
    "export_stash_peak_bytes": "Peak of export_stash_bytes since start.",
    "export_stash_last_bytes": "Bytes of rows the most recent extend that kept any kept (0 held once stored).",
    "export_full_peak_bytes": "Peak bytes of one extend's full exported states and pre-conv rows (not held).",
    "tracked_requests": "Requests the cache keeps match-time data for (admitted, not yet released).",
    "memory_budget_bytes": "Unified memory: the one budget for MLA KV, active states and checkpoints.",
    "memory_kv_bytes": "Unified memory: bytes of blocks holding MLA KV.",
    "memory_kv_used_bytes": "Unified memory: bytes of live KV tokens in those blocks.",
    "memory_active_bytes": "Unified memory: bytes of blocks holding running requests' states.",
    "memory_checkpoint_bytes": "Unified memory: bytes of blocks holding checkpoints.",
    "memory_free_bytes": "Unified memory: bytes of free blocks.",
    "memory_reserved_bytes": "Unified memory: the padding block.",
    "memory_largest_free_run_bytes": "Unified memory: the longest run of free blocks, in bytes.",
    "memory_peak_kv_bytes": "Unified memory: peak of memory_kv_bytes.",
    "memory_peak_checkpoint_bytes": "Unified memory: peak of memory_checkpoint_bytes.",
    "memory_peak_active_bytes": "Unified memory: peak of memory_active_bytes (most running states at once).",
    "tier_host_bytes": "Host tier (--k3-host-tier-gib): bytes of objects held.",
    "tier_host_objects": "Host tier: objects held (KV blocks and boundaries).",
    "tier_host_spare_bytes": "Host tier: bytes of dropped objects' buffers kept for new ones (within the budget).",
    "tier_host_budget_bytes": "Host tier: its budget (0: off).",
    "tier_l3_segment_bytes": "Mooncake tier (--k3-mooncake): the segment this instance contributes (0: off or none).",
    **{
        f"reuse_{c}_value": f"Retention's estimate of the prefill FLOPs a {what} saves when used again "
        "(hits and ghost hits), per state."
        for c, what in REUSE_CLASSES.items()
    },
}
COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups in the k3 tree.",
    "requested_tokens": "Tokens looked up.",
    "hit_tokens": "Tokens restored from a checkpoint (sum of restore boundaries).",
    "mla_hit_tokens": "Tokens whose MLA KV was in the tree at lookup.",
    "replayed_tokens": "Tokens with KV in the tree recomputed because the nearest checkpoint was earlier.",
    "evicted_kv_tokens": "KV tokens evicted.",
    "evicted_checkpoints": "Checkpoints evicted.",
    "evicted_checkpoint_bytes": "Checkpoint bytes evicted.",
    "recycled_checkpoints": (
        "States the placement rules let go (superseded chunk ends, the per-path cap, one state per turn): at once, "
        "or, deferred while memory was free, at the next shortage."
    ),
    "deferred_checkpoints": (
        "States those rules let go while the unified budget had free memory: kept, matchable, first to go when short."
    ),
    "deferred_hits": "Hits on deferred states: prefills the rules' drops would have recomputed.",
    "waiting_refreshes": (
        "Refreshes of the waiting queue's prefixes: what queued requests will restore from is evicted last, "
        "the queue's tail first."
    ),
    "evicted_wanted_checkpoints": "Of evicted_checkpoints, ones a waiting request would have restored from.",
    "deferred_restore_flushes": "Extend forwards that restored quantized checkpoint hits (one launch each).",
    "deferred_restores": "Quantized checkpoint hits restored at their forward (divided by flushes: the batch size).",
    "export_ahead_stored": "Exported states stored into quantized checkpoints, all of a forward's in one launch.",
    "export_ahead_unclaimed": "Of those, released unclaimed (the cache already had a checkpoint there).",
    "store_flushes": "Scheduler steps whose quantized checkpoint stores ran together (one launch each).",
    "stores_flushed": "Quantized checkpoints of running/finishing requests stored by those launches.",
    "export_dropped_unconsumed": (
        "Sequences whose exported states were dropped unused: the next extend began first "
        "(an aborted request, an overlapped prefill)."
    ),
    "stale_state_skips": "Live-state copies not made: the overlap scheduler had moved the slot past the boundary.",
    "unkeyed_state_skips": (
        "States not kept: the boundary ends inside a running request's last KV page (--page-size over 1), "
        "which the tree does not hold yet."
    ),
    "kv_page_copies": (
        "Restores inside a KV page: the prefix's slots in that page copied to a page of the request's own."
    ),
    "hits_retaken_for_slot": (
        "Hits let go because no state slot was free for their copy (the last one held by pinned checkpoints): "
        "the request took a slot and was matched again."
    ),
    "matches_not_admitted": (
        "Requests matched while a prefill batch was filled, then not admitted (no room): their pinned hits released."
    ),
    "state_slot_refusals": (
        "Unified memory: prefill admissions stopped because no KDA state slot could be had, even by eviction "
        "(the request waits for a running one to finish)."
    ),
    "speculative_stops_rewound": (
        "Speculative decoding: requests that stopped inside a verify's accepted tokens, their state set back to "
        "the stop from the verify's per-token scratch so the turn is cached."
    ),
    "speculative_stops_lost": (
        "Speculative decoding: such requests whose turn could not be cached (a draft tree, or the overlap "
        "scheduler already ran the next verify): SGLang inserts nothing for them."
    ),
    "memory_blocks_to_kv": "Unified memory: blocks MLA KV took over.",
    "memory_blocks_to_active": "Unified memory: blocks active states took over.",
    "memory_blocks_to_checkpoints": "Unified memory: blocks checkpoints took over.",
    "memory_reclaims": "Unified memory: shortages met by evicting KV and checkpoints.",
    "memory_reclaim_evicted_bytes": "Unified memory: bytes those evictions freed (fragmentation shows here).",
    "memory_active_overflows": "Unified memory: state slots given beyond the active reserve, from free blocks.",
    "tier_saves": "Lower tiers: boundaries (state + KV of their prefix) written below the device.",
    "tier_save_failures": "Lower tiers: boundaries a tier could not take (full): not kept there.",
    "tier_saved_kv_blocks": "Lower tiers: 64-token MLA KV blocks written.",
    "tier_save_seconds": "Lower tiers: seconds saves took on the scheduler's thread (lookups, reads off the device).",
    "tier_save_dropped": "Lower tiers: saves dropped, the writes in flight holding --k3-tier-write-queue-mib already.",
    "tier_writes_queued": "Lower tiers: saves handed to the writer thread.",
    "tier_write_seconds": "Lower tiers: seconds spent sealing and putting objects (in the writer thread when queued).",
    "tier_lookups": "Lower tiers: admissions that looked below the device.",
    "tier_loads": "Lower tiers: boundaries brought back to the device (hits below the device).",
    "tier_load_tokens": "Lower tiers: prefix tokens gained over the device's own restore point.",
    "tier_load_kv_tokens": "Lower tiers: MLA KV tokens copied back to the device.",
    "tier_load_bytes": "Lower tiers: bytes read back.",
    "tier_find_seconds": "Lower tiers: seconds hashing prompts and asking the tiers (admission, holds, prefetches).",
    "tier_load_seconds": "Lower tiers: seconds spent fetching, checking and copying back.",
    "tier_load_no_memory": "Lower tiers: boundaries found but not loaded, the device being full of pinned data.",
    "tier_invalid_objects": "Lower tiers: objects that failed validation (key, layout, checksum): misses.",
    "tier_incomplete": "Lower tiers: boundaries whose part vanished between lookup and load: misses.",
    "tier_host_hits": "Host tier: loads whose boundary came from host memory.",
    "tier_host_evictions": "Host tier: objects evicted, least recently used first.",
    "tier_host_recycled": "Host tier: objects built in a spare buffer instead of fresh memory.",
    "tier_host_pin_registered": "Host tier on CUDA: buffers page-locked (cudaHostRegister).",
    "tier_host_pin_failures": "Host tier on CUDA: buffers the driver would not page-lock (left pageable).",
    "tier_host_pin_stale_ranges": "Host tier on CUDA: new mappings found registered already (kept unused).",
    "tier_host_pin_unregister_failures": "Host tier on CUDA: freed buffers not unregistered (mapping kept).",
    "tier_errors": "Lower tiers: exceptions raised by a tier (logged; the device cache carried on).",
    "tier_l3_hits": "Mooncake tier: loads whose boundary came from the Mooncake store.",
    "tier_host_hit_tokens": "Host tier: prefix tokens its loads gained over the device's own restore point.",
    "tier_l3_hit_tokens": "Mooncake tier: prefix tokens its loads gained over the device's own restore point.",
    "tier_parked": "Lower tiers: prompt states saved straight below the device (--k3-tier-park-interval).",
    "tier_prefetches": "Lower tiers: copies into host memory started for waiting requests.",
    "tier_held": "Lower tiers: waiting requests held back while their boundary was copied up to host memory.",
    "tier_held_seconds": "Lower tiers: seconds those requests were held, summed (until the copy landed or failed).",
    "tier_held_expired": "Lower tiers: held requests let go after 10 s with their copy still running.",
    "tier_hold_lookups": "Lower tiers: lookups deciding whether to hold a waiting request (at first, after evictions).",
    "tier_hold_waits": "Lower tiers: scheduling calls with only held requests that waited (<= 5 ms) for a copy up.",
    "tier_prefetch_bytes": "Lower tiers: bytes those copies moved up.",
    "tier_prefetch_seconds": "Lower tiers: seconds the prefetch thread spent copying.",
    "tier_prefetch_failures": "Lower tiers: prefetches that found a part gone or the host tier full.",
    "tier_prefetch_hits": "Lower tiers: loads served from host memory because a prefetch put the boundary there.",
    "tier_prefetch_lead_seconds": "Lower tiers: for those, seconds from the prefetch's start to the load (queue time).",
    "tier_l3_puts": "Mooncake tier: objects written.",
    "tier_l3_put_refused": "Mooncake tier: puts refused (no segment has room, or the master is unreachable).",
    "tier_l3_get_hits": "Mooncake tier: objects read.",
    "tier_l3_errors": "Mooncake tier: calls that failed (master down, RPC error): counted as misses.",
    "miss_never_seen_tokens": "Prompt tokens not restored: no MLA KV for them, and the cache never held it.",
    "miss_kv_evicted_tokens": "Prompt tokens not restored: the cache held their MLA KV and evicted it.",
    "miss_no_state_tokens": "Prompt tokens not restored: KV present, but no state was placed near them.",
    "miss_state_dropped_tokens": (
        "Prompt tokens not restored: a state there was let go by a placement rule (turn end, recycling)."
    ),
    "miss_state_evicted_tokens": "Prompt tokens not restored: a state there was evicted (no lower tier is on).",
    "miss_tier_missing_tokens": (
        "Prompt tokens not restored: their state or KV was evicted with a lower tier on, and no tier gave it back."
    ),
    "miss_alignment_tokens": "Prompt tokens not restored: the last token of a fully cached prompt.",
    **{
        f"reuse_{c}_{k}": f"Retention: {what}s {doc}."
        for c, what in REUSE_CLASSES.items()
        for k, doc in (("judged", "observed"), ("used", "used again (a hit, or a hit on its ghost)"))
    },
}
# Present (0) when no lower tier is on, so the series exist either way.
TIER_FIELDS = tuple(f for f in (*GAUGES, *COUNTERS) if f.startswith("tier_"))


def metric_name(field: str) -> str:
    """The exposed series name for a stats field (counters end in ``_total``)."""
    return METRIC_PREFIX + field + ("_total" if field in COUNTERS else "")


class ReqMatch(NamedTuple):
    restore_len: int
    replayed_tokens: int
    kv_match_len: int


def cache_stats(cache) -> dict[str, Any]:
    """The k3 cache's counters and levels: the lifecycle's (tree, store, tiers), the forward's
    (export stash, deferred restores), the page copies and the unified budget's split."""
    cache.lifecycle.forget_done()
    d = cache.lifecycle.stats()
    stash, restores = cache.fwd.stash, cache.fwd.restores
    d.update(
        # Exported chunk-boundary rows held between a forward and its checkpoints (memory
        # SGLang's planner does not budget), and what keeping the full tensors would pin.
        export_stash_bytes=stash.stash_bytes(),
        export_stash_peak_bytes=stash.peak_bytes,
        export_stash_last_bytes=stash.last_kept_bytes,
        export_full_peak_bytes=stash.peak_exported_bytes,
        export_dropped_unconsumed=stash.dropped_unconsumed,
        # quantized hits restored at the forward, batched: average batch = restored / flushes
        deferred_restore_flushes=restores.flushes,
        deferred_restores=restores.restored,
        kv_page_copies=cache.kv_page_copies,
        matches_not_admitted=cache.matches_not_admitted,
        state_slot_refusals=cache.state_slot_refusals,
        speculative_stops_rewound=cache.speculative_stops_rewound,
        speculative_stops_lost=cache.speculative_stops_lost,
        hits_retaken_for_slot=cache.hits_retaken_for_slot,
    )
    d.update(memory_split(cache))
    return d


def memory_split(cache) -> dict:
    """Bytes per kind in the unified budget (zeros without it), and how the split moved."""
    if cache.unified is None:
        return dict.fromkeys(MEMORY_FIELDS, 0)
    led = cache.ledger
    split = led.bytes_by_kind()
    c = led.counters
    return {
        "memory_budget_bytes": led.geom.budget_bytes,
        "memory_kv_bytes": split["kv_bytes"],
        "memory_kv_used_bytes": split["kv_used_bytes"],
        "memory_active_bytes": split["active_bytes"],
        "memory_checkpoint_bytes": split["checkpoint_bytes"],
        "memory_free_bytes": split["free_bytes"],
        "memory_reserved_bytes": split["reserved_bytes"],
        "memory_largest_free_run_bytes": led.largest_free_run(),
        "memory_blocks_to_kv": c.blocks_to_kv,
        "memory_blocks_to_active": c.blocks_to_active,
        "memory_blocks_to_checkpoints": c.blocks_to_ckpt,
        "memory_peak_kv_bytes": c.peak_kv_blocks * led.geom.block_bytes,
        "memory_peak_checkpoint_bytes": c.peak_ckpt_blocks * led.geom.block_bytes,
        "memory_peak_active_bytes": c.peak_active_blocks * led.geom.block_bytes,
        "memory_reclaims": c.reclaims,
        "memory_reclaim_evicted_bytes": c.reclaim_evicted_bytes,
        "memory_active_overflows": c.active_overflows,
    }


MEMORY_FIELDS = (
    "memory_budget_bytes",
    "memory_kv_bytes",
    "memory_kv_used_bytes",
    "memory_active_bytes",
    "memory_checkpoint_bytes",
    "memory_free_bytes",
    "memory_reserved_bytes",
    "memory_largest_free_run_bytes",
    "memory_blocks_to_kv",
    "memory_blocks_to_active",
    "memory_blocks_to_checkpoints",
    "memory_peak_kv_bytes",
    "memory_peak_checkpoint_bytes",
    "memory_peak_active_bytes",
    "memory_reclaims",
    "memory_reclaim_evicted_bytes",
    "memory_active_overflows",
)


def server_snapshot(cache) -> dict[str, Any]:
    """The cache's counters and levels, as plain numbers (the ``/server_info`` entry)."""
    snap: dict[str, Any] = cache_stats(cache)
    for f in TIER_FIELDS:
        snap.setdefault(f, 0)
    snap["checkpoint_slot_bytes"] = int(cache.store.slot_bytes)
    snap["checkpoint_dtype"] = str(cache.store.dtype)
    return snap


# ---------------------------------------------------------------------------- Prometheus
class _Exporter:
    """The ``sglang_k3_*`` series of one scheduler process."""

    def __init__(self, labels: dict[str, Any]):
        # After PROMETHEUS_MULTIPROC_DIR is set (it is, in the scheduler process), like upstream.
        from prometheus_client import Counter, Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.gauges = {
            f: Gauge(metric_name(f), doc, labelnames=names, multiprocess_mode="mostrecent").labels(**self.labels)
            for f, doc in GAUGES.items()
        }
        self.counters = {
            f: Counter(metric_name(f), doc, labelnames=names).labels(**self.labels) for f, doc in COUNTERS.items()
        }
        self.last: dict[str, Any] = {}

    def update(self, snap: dict[str, Any]) -> None:
        if snap == self.last:
            return
        for f, g in self.gauges.items():
            if snap.get(f) != self.last.get(f):
                g.set(float(snap[f]))
        for f, c in self.counters.items():
            delta = snap[f] - self.last.get(f, 0)
            if delta > 0:
                c.inc(delta)
        self.last = dict(snap)


_exporter: Optional[_Exporter] = None
_exporter_failed = False


def _metrics_enabled(scheduler) -> bool:
    if getattr(scheduler, "metrics_collector", None) is None:
        return False  # --enable-metrics is off
    ctx = getattr(scheduler, "metrics_collector_context", None)
    # Like upstream's series: the stats-logging rank, or all with --enable-metrics-for-all-schedulers.
    return bool(getattr(ctx, "current_scheduler_metrics_enabled", True))


def update_metrics(scheduler, snap: Optional[dict[str, Any]] = None) -> None:
    """Refresh this scheduler's ``sglang_k3_*`` series (no-op without --enable-metrics or k3)."""
    global _exporter, _exporter_failed
    if _exporter_failed or not _metrics_enabled(scheduler):
        return
    from sglang_k3.integration.scheduler_verbs import verbs_of

    verbs = verbs_of(getattr(scheduler, "tree_cache", None))
    if verbs is None:
        return
    if _exporter is None:
        try:
            _exporter = _Exporter(dict(scheduler.metrics_collector.labels))
        except Exception:
            _exporter_failed = True  # never take the scheduler down for a metric
            logger.exception("sglang-k3: cannot register the sglang_k3_* metrics")
            return
    _exporter.update(snap if snap is not None else verbs.snapshot())


# ---------------------------------------------------------------------------- per request
def record_match(req, cache, lookups_before: int, result) -> None:
    """Store on ``req`` what its admitting lookup found. ``result`` is upstream's MatchResult;
    the tree's last match record is used only if this call made it."""
    restore = int(result.device_prefix_len)
    stats = cache.tree.stats
    if stats.lookups == lookups_before + 1 and stats.recent:
        rec = stats.recent[-1]
        # The record's restore equals ``restore`` unless SGLANG_RADIX_FORCE_MISS zeroed the hit:
        # then the tokens it would have restored are replayed too.
        replayed = rec.replayed_tokens + max(0, rec.restore_len - restore)
        kv_match = rec.mla_len
    else:  # not looked up (an empty key, or a LoRA / cache-salt namespace the tree does not share)
        replayed, kv_match = 0, 0
    setattr(req, REQ_MATCH_ATTR, ReqMatch(restore, replayed, kv_match))


class K3OutputStreamerMixin:
    """Adds the k3 per-request fields to the generation output, once per request (its first
    output: the first stream chunk, or the finished response)."""

    __slots__ = ()
    has_additional_customized_info = True

    def build_additional_customized_info(self, reqs):
        out = dict(super().build_additional_customized_info(reqs))
        cols: dict[str, list] = {k: [] for k in META_KEYS}
        for req in reqs:
            m = getattr(req, REQ_MATCH_ATTR, None)
            if m is None or getattr(req, REQ_SENT_ATTR, False):
                for k in META_KEYS:
                    cols[k].append([])
                continue
            setattr(req, REQ_SENT_ATTR, True)
            cols[META_RESTORE_LEN].append([m.restore_len])
            cols[META_REPLAYED_TOKENS].append([m.replayed_tokens])
            cols[META_KV_MATCH_LEN].append([m.kv_match_len])
        out.update(cols)
        return out


_streamer_classes: dict[type, type] = {}


def streamer_class(base: type) -> type:
    """``base`` (upstream's streamer or another plugin's subclass of it) with the k3 fields."""
    cls = _streamer_classes.get(base)
    if cls is None:
        cls = type(f"K3{base.__name__}", (K3OutputStreamerMixin, base), {"__slots__": ()})
        _streamer_classes[base] = cls
    return cls
