"""The ``k3`` radix cache: SGLang's prefix-cache interface over the k3 request lifecycle.

Why a direct ``BasePrefixCache`` and not a subclass of upstream's unified-cache components: the
tree logic (two-phase lookup, checkpoints anywhere inside a node, Marconi-style utility eviction,
the three K3 concurrency invariants) and one request's lifecycle (match, checkpoint, finish,
release: :mod:`sglang_k3.cache.lifecycle`) are torch-free, so the same code runs here and in the
trace replay. This class only translates: SGLang requests, tensors and pools in, ints and handles
to the lifecycle, and back. It owns three things the lifecycle does not know about: SGLang's
request fields (``req.kv``, ``req.lock``), the KV index rows, and the forward-side state (the
export stash and the deferred restores, :mod:`sglang_k3.state.forward_state`).

The contract with SGLang 0.5.23's scheduler is written down, hook by hook, in
``docs/sglang_cache_contract.md``; the calls beyond ``BasePrefixCache`` go through
:mod:`sglang_k3.integration.scheduler_verbs`. In short, under ``--mamba-radix-cache-strategy
no_buffer``: checkpoints are fp32 mamba-pool slots or int8/bf16 slots of a checkpoint pool
(:mod:`sglang_k3.state.checkpoint_store`), in the unified budget by default. A hit pins its
checkpoint (invariant 1) and gives the request a private slot that becomes a copy of it at the
request's next forward (fp32: SGLang's ``mamba_cow_src_index``; int8/bf16: dequantized at the
first KDA layer, all hits of the forward in one launch); the pin is released at the request's
first ``checkpoint``, at release, at a re-match, or when the prefill adder refuses it
(:meth:`K3RadixCache.match_not_admitted`). ``req.lock`` protects the request's KV path, not the
checkpoints on it. A chunk or prompt end copies the live slot; a finished request's slot is
donated when its state length equals the key length, else freed (a state is never stored under a
key it does not belong to). A checkpoint is matchable only once its copy is issued (invariant 2).
Under the overlap scheduler a live slot is copied only when ``req.kv.kv_committed_len`` equals the
boundary (``stale_state_skips`` otherwise). With pages over one token a restore inside a page
copies that page's prefix slots to a page of the request's own (:meth:`prefix_device_indices`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

from sglang_k3.cache import CheckpointKind, EvictionPolicy
from sglang_k3.cache.build import build_lifecycle, check_page_size
from sglang_k3.cache.cost_model import from_hf_config
from sglang_k3.cache.unified_eviction import UnifiedEviction
from sglang_k3.config import K3Config
from sglang_k3.integration.cache_memory import CacheMemory
from sglang_k3.integration.observability import cache_stats, server_snapshot
from sglang_k3.integration.scheduler_verbs import SchedulerVerbs
from sglang_k3.integration.tier_setup import build_tiers
from sglang_k3.integration.unified_memory import checkpoint_buffers, index_tensor, mla_pool_of, unified_of
from sglang_k3.integration.waiting_queue import WaitingQueue, request_namespaced
from sglang_k3.state.active_slots import SlotPool
from sglang_k3.state.checkpoint_store import LedgerSlots, UnifiedCheckpointMemory, make_store
from sglang_k3.state.deferred_restore import DeferredRestores
from sglang_k3.state.export_stash import ExportStash, ExportView
from sglang_k3.state.forward_state import ForwardState, attach

logger = logging.getLogger(__name__)


class K3RadixCache(CacheMemory, WaitingQueue, BasePrefixCache):
    def __init__(self, params, cfg: K3Config, hf_config: Optional[dict] = None, tier_ctx=None):
        self.page_size = params.page_size or 1
        check_page_size(self.page_size)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.disable = False
        self.cfg = cfg
        # What the scheduler's patches call beyond BasePrefixCache (scheduler_verbs.verbs_of).
        self.scheduler_verbs = SchedulerVerbs(self)
        self._kv_device = self.req_to_token_pool.req_to_token.device
        # The forward-side state this cache owns, reached by the KDA backend hooks through the
        # pool SGLang hands to both (sglang_k3/state/forward_state.py).
        self.fwd = ForwardState(ExportStash(), DeferredRestores())
        attach(self.req_to_token_pool, self.fwd)
        # Requests matched while the current prefill batch is filled -> tokens they will prefill
        # (the room lower tiers may load into is what is left: _tier_room).
        self._round_extend: dict[str, int] = {}
        self.kv_page_copies = 0  # restores inside a page: partial pages copied (prefix_device_indices)
        self.matches_not_admitted = 0  # matched in a prefill loop, then not admitted (match_not_admitted)
        self.state_slot_refusals = 0  # admissions refused: no state slot to be had (state_slots_ready)
        self.speculative_stops_rewound = 0  # stopped inside a verify's tokens, cached anyway (rewind_to_stop)
        self.speculative_stops_lost = 0  # the same, not cacheable (rewind_to_stop)
        self.hits_retaken_for_slot = 0  # hits let go so the request could take a state slot
        self._evicted_at_refresh = 0  # the tree's evictions when the waiting queue was last refreshed
        self.eviction_refresh = False  # True during a refresh k3 asked for (refresh_waiting_now)
        self.slots = SlotPool(self.req_to_token_pool, self._evict_slots)
        # Unified memory (the default): KV, active states and checkpoints share one budget that
        # patches/kv_cache_configurator_init_pools.py built; None with --k3-no-unified-memory.
        self.unified = unified_of(self.req_to_token_pool)
        ckpt_memory = None
        if self.unified is not None:
            self.ledger = self.unified.ledger
            ckpt_memory = UnifiedCheckpointMemory(checkpoint_buffers(self.unified), LedgerSlots(self.ledger))
            self.req_to_token_pool.mamba_allocator.evict_blocks = self._evict_for_active
            kv_alloc = self.token_to_kv_pool_allocator
            kv_alloc.reclaimable_blocks = self._reclaimable_checkpoint_blocks
            kv_alloc.evict_for_kv = self._evict_checkpoints_for_kv
        self.store = make_store(
            cfg.checkpoint_dtype,
            self.slots,
            cfg.checkpoint_slots,
            self._evict_for_checkpoint,
            self.fwd,
            ckpt_memory,
            pooled=cfg.lower_tiers,
        )
        # Lower tiers (--k3-host-tier-gib): evicted boundaries go to host memory, admitted requests
        # bring the deepest usable one back (sglang_k3.tiers); None when off.
        self.tiers = build_tiers(cfg, tier_ctx, mla_pool_of(self.token_to_kv_pool_allocator.get_kvcache()), self.store)
        self.lifecycle = build_lifecycle(
            cfg,
            self.store,
            _eviction_policy(hf_config),
            self._free_kv,
            tiers=self.tiers,
            alloc_kv=self._alloc_kv,
            page_size=self.page_size,
            has_slack=self.ledger.has_slack if self.unified is not None else None,
        )
        if self.unified is not None:
            self.evictor = UnifiedEviction(self.lifecycle, self.ledger, keep_checkpoints=cfg.min_checkpoints)
        self.tree = self.lifecycle.tree
        self.placement = self.lifecycle.placement
        self.root_node = self.tree.root
        # The extend forward keeps, of its chunk-boundary states, the ones we may store.
        self.fwd.stash.enable(
            self._export_plan,
            conv_width=int(self.slots.pool.mamba_cache.conv[0].shape[-2]),
            num_layers=int(self.slots.pool.mamba_cache.temporal.shape[0]),
        )
        logger.info(
            "k3 radix cache: %s checkpoints of %d bytes, placement %s",
            self.store.dtype,
            self.store.slot_bytes,
            self.placement,
        )

    # ---------------------------------------------------------------- identity
    def supports_mamba(self) -> bool:
        return True

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self.tree.root

    # ---------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        root = self.tree.root
        miss = MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)
        if key.extra_key is not None or key.cache_salt is not None or len(key) == 0:
            return miss  # LoRA / cache-salt namespaces are not shared through this tree
        req = params.req if params.cow_mamba else None
        tokens = list(key.raw_token_ids())
        res = self.lifecycle.match(
            None if req is None else req.rid,
            tokens,
            admit=req is not None,
            prompt_len=None if req is None else len(req.origin_input_ids),
            is_done=None if req is None else req.finished,
            tier_room=None if req is None else self._tier_room(req.rid),
        )
        if req is not None and self.lifecycle.tiers is not None:
            self._round_extend[req.rid] = len(tokens) - res.restore_len
        if res.restore_len == 0:
            return miss
        if req is not None:
            try:
                self._cow_into_request(req, res.handles[0])
            except NoStateSlot:
                return self._match_after_taking_a_slot(params, miss)
            except BaseException:
                self.lifecycle.release_pin(req.rid)
                raise
        node = res.node
        return MatchResult(
            device_prefix_len=res.restore_len,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            full_kv_hit_length=res.mla_len,
            # a restore inside a page: the request's copy of that page (prefix_device_indices) is
            # its own, so only the whole pages before it are protected
            cache_protected_len=None if self.page_size == 1 else res.restore_len - res.kv_cow_tokens,
        )

    def prefix_device_indices(self, req) -> torch.Tensor:
        """The KV slots of ``req``'s matched prefix, read when its KV is allocated. A restore
        inside a page (a ragged leaf's exact end, ``--page-size`` over 1) would have SGLang's
        paged allocator write the request's next tokens into the rest of that page, which the
        tree holds: the prefix's slots in it are copied to a fresh page of the request's own."""
        idx = super().prefix_device_indices(req)
        cow = len(idx) % self.page_size
        if cow == 0:
            return idx
        page = self._alloc_kv_page()
        dst = page[:cow]
        self.token_to_kv_pool_allocator.get_kvcache().move_kv_cache(dst, idx[-cow:])
        self.kv_page_copies += 1
        return torch.cat([idx[:-cow], dst])

    def _alloc_kv_page(self) -> torch.Tensor:
        alloc = self.token_to_kv_pool_allocator
        page = alloc.alloc(self.page_size)
        if page is None:
            self.evict(EvictParams(num_tokens=self.page_size))
            page = alloc.alloc(self.page_size)
        if page is None:
            raise RuntimeError(
                "k3 cache: no free KV page to copy a restored partial page into "
                f"({alloc.available_size()} tokens free, {self.evictable_size()} evictable)"
            )
        return page

    def _cow_into_request(self, req, handle: int) -> None:
        """Give ``req`` a private slot whose state will be a copy of checkpoint ``handle`` when its
        next forward reads it (the checkpoint stays pinned until then)."""
        if not req.kv.holds_mamba and not self._give_slot(req):
            raise NoStateSlot(req.rid)
        src = self.store.restore(handle, req.rid, int(req.kv.mamba_pool_idx))
        req.kv.mamba_cow_src_index = None if src is None else self.slots.index_tensor(src)
        req.kv.mamba_needs_clear = False

    def _match_after_taking_a_slot(self, params: MatchPrefixParams, miss: MatchResult) -> MatchResult:
        """A hit found no state slot for its copy: with unified memory, the only slot SGLang's
        count left free can be held by checkpoints that cannot go while pinned, the very one the
        hit restores from among them (a tier promotion or a fresh store put it in the last free
        blocks, and free memory elsewhere is in runs too short for a state). Measured: the live
        tier A/B's Mooncake server stopped here. So the hit lets go of its pin, the request takes
        the slot (evicting what borrowed it, now free to go) and is matched again, once, holding
        it: it restores from what is left, or recomputes, instead of stopping the server
        (``hits_retaken_for_slot``). Without a slot even then, it is a miss and SGLang's own slot
        allocation follows."""
        req = params.req
        self.lifecycle.release_pin(req.rid)
        self.hits_retaken_for_slot += 1
        if not self._give_slot(req):
            logger.warning("k3 cache: no KDA state slot for request %s even after its hit let go; a miss", req.rid)
            return miss
        req.kv.mamba_needs_clear = True  # a fresh state unless the second match restores into it
        return self.match_prefix(params)

    def _give_slot(self, req) -> bool:
        """A free state slot (evicting checkpoints if need be) becomes ``req``'s; False if none."""
        dst = self.slots.alloc()
        if dst is None:
            return False
        req.kv.mamba_pool_idx = torch.tensor(dst, dtype=torch.int64, device=self.slots.device)
        return True

    # ---------------------------------------------------------------- locks and paths
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if node is not None and node is not self.tree.root:
            self.tree.inc_lock_ref(node)
        return IncLockRefResult()

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        if node is not None and node is not self.tree.root:
            self.tree.dec_lock_ref(node)
        return DecLockRefResult()

    def path_device_indices(self, node: Any) -> torch.Tensor:
        kv = [] if node is self.tree.root else self.tree.path_kv(node)
        return index_tensor(kv, self._kv_device)

    # ---------------------------------------------------------------- insert / checkpoint
    def checkpoint(self, req, *, up_to: int, kind: Optional[CheckpointKind] = None, **kwargs) -> None:
        self.lifecycle.release_pin(req.rid)  # a forward has run since the match: the copy has landed
        try:
            self._checkpoint(req, up_to, kind)
        finally:
            self._consume_export(req)

    def _checkpoint(self, req, up_to: int, kind: Optional[CheckpointKind]) -> None:
        finished = req.finished()
        if request_namespaced(req) or up_to <= 0:
            if finished:
                self._release_request_slot(req)
            return
        row = req.kv.req_pool_idx
        kv_row = self.req_to_token_pool.req_to_token[row, :up_to]
        # a finished request writes no more KV: the tree may keep its last page partial, so the
        # state at its exact end has a key (with pages over one token)
        ins = self.lifecycle.insert(list(req.full_untruncated_fill_ids[:up_to]), kv_row.tolist(), ragged=finished)
        start = req.kv.cache_protected_len
        # the row takes the tree's KV where the tree held these tokens under other slots (the freed
        # duplicates); with none the row already is the tree's path: no path list, no device copy
        if ins.inserted_len > start and ins.duplicate_kv:
            tree_kv = self.path_device_indices(ins.node)
            self.req_to_token_pool.req_to_token[row, start : ins.inserted_len] = tree_kv[start : ins.inserted_len].to(
                self.req_to_token_pool.req_to_token.dtype
            )
        self.unlock(req.lock)
        req.lock = self.lock(ins.node)
        req.last_node = ins.node
        req.kv.cache_protected_len = ins.inserted_len
        if hasattr(req.kv, "cache_inserted_len"):
            req.kv.cache_inserted_len = ins.inserted_len
        if not req.kv.holds_mamba:
            return
        active = int(req.kv.mamba_pool_idx)
        seq = self.fwd.stash.lookup(active, up_to)
        if seq is not None:
            self.lifecycle.store_exports(req.rid, ins.node, up_to, ExportView(self.fwd.stash, seq))
        if finished:  # its insert was ragged: the tree holds all of up_to
            self._consume_export(req)
            req.kv.mamba_pool_idx = None  # donated, queued for its store, or released
            self.lifecycle.finish(ins.node, up_to, req.kv.kv_committed_len, active, rid=req.rid)
        elif ins.inserted_len == up_to:
            # the slot holds the tokens of every step launched so far (SGLang counts a step in
            # kv_committed_len when it prepares it): under overlap that may be one past up_to
            state_len = req.kv.kv_committed_len
            self.lifecycle.checkpoint_running(req.rid, ins.node, up_to, active, kind, state_len=state_len)
        else:
            # A running request's last page is still being written, so the tree keeps only its
            # whole pages: with pages over one token a boundary inside the last page has no key
            # yet, and the live state is not stored there (the exported grid state below stands in).
            self.lifecycle.counters.unkeyed_state_skips += 1

    def _consume_export(self, req) -> None:
        """The request has checkpointed after its extend: the stash may drop its rows."""
        if req.kv.mamba_pool_idx is not None:
            self.fwd.stash.consume(int(req.kv.mamba_pool_idx))

    def checkpoint_decode(self, req, advanced: int = 1) -> None:
        """After a decode step that committed ``advanced`` tokens (several under a speculative
        verify): when it crossed a multiple of ``--k3-decode-checkpoint-interval``, insert the
        request's path so far and fork its state there (a recyclable DECODE checkpoint)."""
        length = req.kv.kv_committed_len  # tokens whose KV is written and whose state is in the slot
        if (
            req.finished()
            or not req.kv.holds_mamba
            or req.kv.req_pool_idx is None
            or not self.lifecycle.decode_due(length, advanced)
        ):
            return
        req.refresh_fill_ids()
        self.checkpoint(req, up_to=length, kind=CheckpointKind.DECODE)

    def rewind_to_stop(self, req, row: int, accepted: int) -> bool:
        """A speculative verify committed ``accepted`` tokens of ``req`` (verify row ``row``) and
        the request stopped inside them (its last tokens are past a stop token or
        ``max_new_tokens``; SGLang keys the tree only up to the stop, ``Req.owned_kv_len``). The
        slot holds the state after all of them, which no key up to the stop can be given, so
        SGLang would insert nothing for the turn (``skip_radix_cache_insert``) and the next turn
        would recompute it. The verify's per-token scratch (``intermediate_ssm`` /
        ``intermediate_conv_window``, the rows the commit read from; overwritten only by the next
        verify) still holds the state after every one of them: copy the one at the stop into the
        slot and shorten the committed length to it, so the turn is inserted as without
        speculation. Draft chains only (step ``t`` is the ``t``-th committed token; with draft
        trees the accepted path's node numbers are not in the result). Returns whether it did."""
        from sglang.srt.runtime_context import get_schedule, get_spec

        kv = req.kv
        stop, committed = req.owned_kv_len(), kv.kv_committed_len
        step = stop - (committed - accepted) - 1
        cache = getattr(self.req_to_token_pool.mamba_pool, "mamba_cache", None)
        inter = getattr(cache, "intermediate_ssm", None)
        if (
            inter is None
            or get_spec().speculative_eagle_topk not in (None, 1)
            or not get_schedule().disable_overlap_schedule  # the next verify may have run already
            or not kv.holds_mamba
            or not 0 <= step < inter.shape[2]
            or stop >= committed
        ):
            self.speculative_stops_lost += 1
            return False
        import torch
        from sglang.kernels.ops.mamba import mamba_state_scatter_triton as commit

        one = lambda i: torch.tensor([int(i)], dtype=torch.int64, device=cache.temporal.device)  # noqa: E731
        # SGLang's own commit of a verify (the CPU patch's on CPU), for this request's stop step
        commit.scatter_mamba_states_after_mtp_verify(
            cache, one(kv.mamba_pool_idx), one(step), None, None, src_indices_raw=one(row)
        )
        kv.kv_committed_len = stop
        self.speculative_stops_rewound += 1
        return True

    def _export_plan(self, rid: str, seq) -> list[int]:
        """The stash's planner, asked when an extend forward begins."""
        return self.lifecycle.export_plan(rid, seq.grid(), seq.end)

    # ---------------------------------------------------------------- one store launch per step
    # Within one ``process_batch_result`` (the scheduler hook opens the scope), the quantized
    # stores of running and finishing requests are queued and run together when it ends: one
    # launch and one refusal-flag sync for the whole step instead of one per request. A queued
    # checkpoint is in the tree but not ready (invariant 2: not matchable, not evictable, and its
    # KV is kept), its checkpoint slot is allocated, and a finished request's active slot is held
    # until the flush. Outside the scope (aborts, tests) stores run at once.
    def begin_store_scope(self) -> None:
        self.lifecycle.begin_store_scope()

    def end_store_scope(self) -> None:
        self.lifecycle.end_store_scope()
        # A batch's results are in: the prefill batch scheduled before them has its KV allocated.
        self._round_extend.clear()

    def flush_stores(self) -> int:
        return self.lifecycle.flush_stores()

    # ---------------------------------------------------------------- release
    def _release_request_slot(self, req) -> None:
        if req.kv.holds_mamba:
            self.store.release_active(int(req.kv.mamba_pool_idx))
            req.kv.mamba_pool_idx = None

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.lifecycle.release(req.rid)
        self._consume_export(req)
        self._release_request_slot(req)

    def release_aborted_request(self, handle) -> None:
        """Upstream's abort of a request that never ran (waiting queue, queue limit, priority)
        reaches the cache only here, with no finished reason set on the request: forget it now
        (its pin, pending restore and match-time data), or it would be tracked forever."""
        self.lifecycle.release(handle.rid)

    def reset(self) -> None:
        # SGLang clears the KV and mamba allocators right after (flush_cache): drop, don't free.
        if hasattr(self, "lifecycle"):
            freed = self.lifecycle.reset()
            if not self.store.shares_active_slots:
                self.store.free(freed.handles)  # our own pool: SGLang does not clear it
            self.root_node = self.tree.root
            self.fwd.restores.clear()
            self.fwd.stash.clear()

    # ---------------------------------------------------------------- observability
    def stats_dict(self) -> dict:
        """Every counter and level of this cache: :func:`sglang_k3.integration.observability.cache_stats`."""
        return cache_stats(self)

    def server_snapshot(self) -> dict:
        """What ``/server_info`` and ``/metrics`` show of this cache (:func:`~sglang_k3.integration.
        observability.server_snapshot`)."""
        return server_snapshot(self)

    def pretty_print(self) -> None:
        print(f"k3 radix cache: {self.stats_dict()}")


class NoStateSlot(RuntimeError):
    """No KDA state slot could be had for a request's cache hit."""


def _eviction_policy(hf_config: Optional[dict]) -> EvictionPolicy:
    """Utility = recency + prefill FLOPs saved per byte, priced with the served model's own
    KDA/MLA/MoE dimensions (token counts when the config is not a Kimi-Linear-style one)."""
    if not hf_config or not hf_config.get("linear_attn_config"):
        return EvictionPolicy()
    kv_dtype = "fp32" if str(hf_config.get("torch_dtype", "")).endswith("float32") else "bf16"
    return EvictionPolicy(cost=from_hf_config(hf_config), kv_dtype=kv_dtype)
