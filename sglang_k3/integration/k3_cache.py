"""The ``k3`` radix cache: SGLang's prefix-cache interface over the pure-Python KDA-aware tree.

Why a direct ``BasePrefixCache`` and not a subclass of upstream's unified-cache components: the
tree logic (two-phase lookup, checkpoints anywhere inside a node, Marconi-style utility eviction,
the three K3 concurrency invariants) lives in :mod:`sglang_k3.cache`, torch-free, so the same
code runs here and in the trace-replay simulator. Upstream's MAMBA component keeps one state per
node end and validates a hit node by node; wrapping it would mean two trees. This class only
translates: SGLang requests, tensors and pools in, ints and handles to the tree, and back.

The contract with SGLang 0.5.23's scheduler is written down in ``docs/sglang_cache_contract.md``.
In short, for a hybrid KDA model under ``--mamba-radix-cache-strategy no_buffer``:

* **Checkpoint storage** (``--k3-checkpoint-dtype``, :mod:`sglang_k3.state.checkpoint_store`):
  ``fp32`` checkpoints are mamba-pool slots (handle = slot index) taken from the same allocator
  as the requests' active slots, so SGLang's idle leak check stays exact; ``int8``/``bf16``
  checkpoints live in a separate checkpoint pool. One KDA group per TP rank (this class serves
  one rank, so one group).
* **Hit (copy-on-write)**: ``match_prefix`` pins the matched checkpoint (invariant 1), then gives
  the request a private slot (evicting checkpoints if needed: the pinned one cannot go). fp32:
  it sets ``mamba_cow_src_index`` and SGLang copies on the forward stream before the KDA layers;
  int8/bf16: the hit is queued and dequantized at the forward's first KDA layer, with the
  forward's other hits in one launch (:mod:`sglang_k3.state.deferred_restore`). The pin is
  held until that copy has landed: it is released at the request's first ``checkpoint`` (after
  its first forward), at release, or when the request is matched again. ``req.lock`` protects the
  request's KV path, not the checkpoints on it: the request's state is its own private copy, so
  checkpoints stay evictable while it runs (a small state pool cannot be locked up by paths).
* **Chunk end / prompt end** (request still running): the live slot is copied into a new slot,
  which the tree keeps; the request keeps its slot (a second slot only at a checkpoint boundary).
* **Finish (donate)**: when the state length equals the key length, the request's slot itself is
  handed to the tree, no copy (fp32; int8/bf16 quantize it into a checkpoint slot). Otherwise it
  is freed: a state is never stored under a key it does not belong to.
* **Ready flag (invariant 2)**: a checkpoint enters the tree not ready and is marked ready right
  after its copy is issued. On CPU the copy is synchronous; on a GPU it is enqueued on the
  forward stream ahead of any forward that could read it.
* **Full match**: the tree caps the restore point at ``len(key) - 1`` and rounds down to the
  nearest checkpoint, so a fully cached prompt still reuses everything up to that checkpoint.
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
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

from sglang_k3.cache import CheckpointKind, EvictionPolicy, K3RadixTree, PlacementPolicy
from sglang_k3.cache.cost_model import from_hf_config
from sglang_k3.integration.k3_args import K3Config
from sglang_k3.state.active_slots import SlotPool
from sglang_k3.state.checkpoint_store import make_store
from sglang_k3.state.deferred_restore import RESTORES
from sglang_k3.state.export_stash import STASH

logger = logging.getLogger(__name__)


class K3RadixCache(BasePrefixCache):
    def __init__(self, params, cfg: K3Config, hf_config: Optional[dict] = None):
        if params.page_size not in (1, None):
            raise ValueError(f"--radix-cache-backend k3 needs --page-size 1 (got {params.page_size})")
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = 1
        self.disable = False
        self.cfg = cfg
        self.slots = SlotPool(self.req_to_token_pool, self._evict_slots)
        self.store = make_store(cfg.checkpoint_dtype, self.slots, cfg.checkpoint_slots, self._evict_checkpoint_bytes)
        self.placement = PlacementPolicy(
            hit_unit=1,
            at_chunk_end=cfg.checkpoint_chunk_end,
            at_prompt_end=cfg.checkpoint_prompt_end,
            at_generation_end=cfg.checkpoint_generation_end,
            at_branch_points=cfg.checkpoint_branch_points,
            decode_interval=cfg.decode_checkpoint_interval or None,
            per_path_budget=cfg.checkpoint_budget or None,
        )
        # hit_unit=1: checkpoints sit exactly where the forward left a state (chunk, prompt and
        # generation ends); the kernel's 64-token grid adds more positions, never fewer.
        self.tree = K3RadixTree(num_groups=1, page_size=1, hit_unit=1, eviction=_eviction_policy(hf_config),
                                lock_protects_checkpoints=False)
        # Pins held until a request's copy-on-write has landed, by request id: (request, pin).
        self._pins: dict[str, tuple[Any, Any]] = {}
        self.root_node = self.tree.root
        self._kv_device = self.req_to_token_pool.req_to_token.device
        # Branch points found at match time (Marconi-style speculative insertion), by request id.
        self._branch_points: dict[str, int] = {}
        # Prompt lengths at match time, by request id: whether an extend reaches the prompt end.
        self._prompt_lens: dict[str, int] = {}
        # The request objects behind those two maps: a request aborted while waiting never reaches
        # on_release, so entries of finished requests are pruned (_forget_finished_requests).
        self._matched: dict[str, Any] = {}
        self._prune_at = 64
        # quantized stores queued within one process_batch_result (see begin_store_scope)
        self._store_scope = 0
        self._store_queue: list = []
        self.store_flushes = 0
        self.stores_flushed = 0
        # The extend forward keeps, of its chunk-boundary states, the ones we may store.
        STASH.enable(self._export_candidates, conv_width=int(self.slots.pool.mamba_cache.conv[0].shape[-2]),
                     num_layers=int(self.slots.pool.mamba_cache.temporal.shape[0]))
        logger.info("k3 radix cache: %s checkpoints of %d bytes, placement %s",
                    self.store.dtype, self.store.slot_bytes, self.placement)

    # ---------------------------------------------------------------- identity
    def supports_mamba(self) -> bool:
        return True

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self.tree.root

    @staticmethod
    def _namespaced(key) -> bool:
        return key.extra_key is not None or key.cache_salt is not None

    # ---------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        root = self.tree.root
        miss = MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)
        if self._namespaced(key) or len(key) == 0:
            return miss  # LoRA / cache-salt namespaces are not shared through this tree
        tokens = list(key.raw_token_ids())
        if params.cow_mamba and params.req is not None:
            self._prompt_lens[params.req.rid] = len(params.req.origin_input_ids)
            self._matched[params.req.rid] = params.req
            if len(self._matched) > self._prune_at:  # amortized: O(1) per match
                self._forget_finished_requests()
                self._prune_at = 2 * len(self._matched) + 64
        if params.cow_mamba and params.req is not None and self.placement.at_branch_points:
            bp = self.tree.find_branch_point(tokens)
            if bp:
                self._branch_points[params.req.rid] = bp
        if params.cow_mamba and params.req is not None:
            self._release_pin(params.req.rid)  # a re-match replaces the previous one
        res = self.tree.match_prefix(tokens, pin=params.cow_mamba)
        if res.restore_len == 0:
            return miss
        if params.cow_mamba:
            try:
                self._cow_into_request(params.req, res.handles[0])
            except BaseException:
                self.tree.release_pin(res.pin)
                raise
            # both stores copy at the next forward: keep the checkpoint pinned until after it
            self._pins[params.req.rid] = (params.req, res.pin)
        node = res.node
        return MatchResult(
            device_prefix_len=res.restore_len,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            full_kv_hit_length=res.mla_len,
        )

    def _release_pin(self, rid) -> None:
        RESTORES.drop(rid)  # a restore not flushed by now is not wanted any more
        held = self._pins.pop(rid, None)
        if held is not None:
            self.tree.release_pin(held[1])

    def _release_finished_pins(self) -> None:
        """Aborted waiting requests never reach ``on_release``: drop their pins (and any restore
        still pending for them). Called before evicting, so their checkpoints become evictable."""
        for rid in [rid for rid, (req, _) in self._pins.items() if req.finished()]:
            self._release_pin(rid)

    def _forget_finished_requests(self) -> None:
        """As :meth:`_release_finished_pins`, and drop their branch points and prompt lengths too.
        Called between scheduler steps only (at match time, amortized, and for the stats), never
        while a finishing request is being checkpointed."""
        self._release_finished_pins()
        for rid in [rid for rid, req in self._matched.items() if req.finished()]:
            self._forget(rid)

    def _forget(self, rid) -> None:
        self._release_pin(rid)
        self._branch_points.pop(rid, None)
        self._prompt_lens.pop(rid, None)
        self._matched.pop(rid, None)

    def _cow_into_request(self, req, handle: int) -> None:
        """Give ``req`` a private slot whose state is (or will be) a copy of checkpoint ``handle``."""
        if not req.kv.holds_mamba:
            dst = self.slots.alloc()
            if dst is None:
                raise RuntimeError("k3 cache: no KDA state slot free for a cache hit")
            req.kv.mamba_pool_idx = torch.tensor(dst, dtype=torch.int64, device=self.slots.device)
        self.store.restore(handle, req)

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
        return torch.tensor(kv, dtype=torch.int64, device=self._kv_device)

    # ---------------------------------------------------------------- insert / checkpoint
    def checkpoint(self, req, *, up_to: int, kind: Optional[CheckpointKind] = None, **kwargs) -> None:
        self._release_pin(req.rid)  # a forward has run since the match: the copy has landed
        finished = req.finished()
        row = req.kv.req_pool_idx
        if _request_namespaced(req) or up_to <= 0:
            if finished:
                self._free_request_slot(req)
            return
        tokens = list(req.full_untruncated_fill_ids[:up_to])
        kv_row = self.req_to_token_pool.req_to_token[row, :up_to]
        ins = self.tree.insert(tokens, kv_row.tolist())
        if ins.duplicate_kv:
            self.token_to_kv_pool_allocator.free(
                torch.tensor(ins.duplicate_kv, dtype=torch.int64, device=self._kv_device)
            )
        start = req.kv.cache_protected_len
        if ins.inserted_len > start:
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
        if req.kv.holds_mamba:
            self._store_exported(req, ins.node, up_to)
        if finished:
            self._checkpoint_finished(req, ins.node, up_to)
        else:
            self._checkpoint_running(req, ins.node, up_to, kind)

    def checkpoint_decode(self, req) -> None:
        """After a decode step: every ``--k3-decode-checkpoint-interval`` tokens, insert the
        request's path so far and fork its state there (a recyclable DECODE checkpoint)."""
        length = req.kv.kv_committed_len  # tokens whose KV is written and whose state is in the slot
        if (
            req.finished()
            or not req.kv.holds_mamba
            or req.kv.req_pool_idx is None
            or not self.placement.decode_checkpoint(length)
        ):
            return
        req.refresh_fill_ids()
        self.checkpoint(req, up_to=length, kind=CheckpointKind.DECODE)

    def _store_exported(self, req, node, up_to: int) -> None:
        """Keep chunk-boundary states the extend just exported: the last one before the prompt
        end (so a repeated or fully contained prompt still hits) and the one at or before a
        branch point found at match time (so requests sharing only that prefix hit)."""
        seq = STASH.lookup(int(req.kv.mamba_pool_idx), up_to)
        if seq is None:
            return
        wanted = self.placement.export_candidates(
            seq.grid(), up_to, len(req.origin_input_ids), self._branch_points.get(req.rid)
        )
        for pos, kind in sorted(wanted.items()):
            if self._has_checkpoint_at(node, pos) or STASH.row(seq, pos) is None:
                continue  # already there, or the forward did not keep that state
            handle = self._pinned(node, self.store.capture_export, seq, pos)
            if handle is None:
                return
            self._register(node, pos, handle, kind)

    def _export_candidates(self, rid: str, seq) -> list[int]:
        """The stash's planner, asked when an extend forward begins: the grid points of ``seq``
        that ``_store_exported`` may store after it (the same rule, with match-time data)."""
        return list(self.placement.export_candidates(
            seq.grid(), seq.end, self._prompt_lens.get(rid), self._branch_points.get(rid)
        ))

    def _pinned(self, node, fn, *args):
        """Run a storing operation (it may allocate and so evict) with the request's path locked
        (invariant 1: pin before allocating)."""
        self.tree.inc_lock_ref(node)
        try:
            return fn(*args)
        finally:
            self.tree.dec_lock_ref(node)

    def _kind_for_running(self, req, up_to: int) -> Optional[CheckpointKind]:
        prompt_len = len(req.origin_input_ids)
        if up_to >= prompt_len:
            return CheckpointKind.PROMPT_END if self.placement.at_prompt_end else None
        return CheckpointKind.CHUNK if self.placement.at_chunk_end else None

    def _checkpoint_running(self, req, node, up_to: int, kind: Optional[CheckpointKind] = None) -> None:
        kind = kind or self._kind_for_running(req, up_to)
        if kind is None or not req.kv.holds_mamba or self._has_checkpoint_at(node, up_to):
            return
        if self._queues_stores():
            self._queue_store(node, up_to, kind, int(req.kv.mamba_pool_idx), release_active=False)
            return
        handle = self._pinned(node, self.store.capture_active, int(req.kv.mamba_pool_idx))
        if handle is None:
            return  # no memory for a checkpoint now: the request goes on, the boundary is not cached
        self._register(node, up_to, handle, kind)

    def _checkpoint_finished(self, req, node, up_to: int) -> None:
        if not req.kv.holds_mamba:
            return
        donate = (
            self.placement.at_generation_end
            and up_to == req.kv.kv_committed_len  # the slot's state is exactly at up_to
            and not self._has_checkpoint_at(node, up_to)
        )
        if not donate:
            self._free_request_slot(req)
            return
        active = int(req.kv.mamba_pool_idx)
        if self._queues_stores():
            req.kv.mamba_pool_idx = None  # the queued store owns the slot until the flush frees it
            self._queue_store(node, up_to, CheckpointKind.GEN_END, active, release_active=True)
            return
        handle = self._pinned(node, self.store.donate, active)
        if self.store.uses_mamba_slots and handle == active:
            req.kv.mamba_pool_idx = None  # the tree owns the slot now
        else:
            self._free_request_slot(req)
        if handle is not None:
            self._register(node, up_to, handle, CheckpointKind.GEN_END)

    # ---------------------------------------------------------------- one store launch per step
    # Within one ``process_batch_result`` (the scheduler hook opens the scope), the quantized
    # stores of running and finishing requests are queued and run together when it ends: one
    # launch and one refusal-flag sync for the whole step instead of one per request. A queued
    # checkpoint is in the tree but not ready (invariant 2: not matchable, not evictable, and its
    # KV is kept), its checkpoint slot is allocated, and a finished request's active slot is held
    # until the flush. Outside the scope (aborts, tests) stores run at once, as before.
    def begin_store_scope(self) -> None:
        self._store_scope += 1

    def end_store_scope(self) -> None:
        self._store_scope -= 1
        if self._store_scope == 0:
            self.flush_stores()

    def _queues_stores(self) -> bool:
        return self._store_scope > 0 and not self.store.uses_mamba_slots

    def _queue_store(self, node, pos: int, kind: CheckpointKind, active: int, release_active: bool) -> None:
        dst = self._pinned(node, self.store.alloc)
        ck = None if dst is None else self._add_pending(node, pos, dst, kind)
        if ck is None:  # no memory for it now, or the boundary is already there
            if release_active:
                self.slots.free([active])
            return
        self._store_queue.append((node, ck, active, dst, release_active))

    def flush_stores(self) -> int:
        """Run the queued stores in one call; a refused (non-finite) state's checkpoint leaves the
        tree. Returns how many were stored."""
        queue, self._store_queue = self._store_queue, []
        if not queue:
            return 0
        res = self.store.pool.store([q[2] for q in queue], [q[3] for q in queue])
        self.store_flushes += 1
        for (node, ck, active, _dst, release_active), ok in zip(queue, res.accepted):
            if ok:
                self.stores_flushed += 1
                self._land(node, ck)
            else:
                self.tree.mark_ready(ck)  # drop_checkpoint takes landed checkpoints only
                self.tree.drop_checkpoint(ck)  # the pool already released the refused slot
            if release_active:
                self.slots.free([active])
        return len(queue)

    def _has_checkpoint_at(self, node, pos: int) -> bool:
        return any(ck.pos == pos for ck in self.tree.path_checkpoints(node))

    def _register(self, node, pos: int, handle: int, kind: CheckpointKind) -> None:
        ck = self._add_pending(node, pos, handle, kind)
        if ck is not None:
            self._land(node, ck)  # the copy (or donation) has been issued: see module docstring

    def _add_pending(self, node, pos: int, handle: int, kind: CheckpointKind):
        """Put ``handle`` in the tree at ``pos``, not ready yet; None (handle freed) if the tree
        already has a checkpoint there."""
        ck = self.tree.add_checkpoint(node, pos, [handle], self.store.slot_bytes, kind=kind, ready=False)
        if ck is None:
            self.store.free([handle])
        return ck

    def _land(self, node, ck) -> None:
        """``ck``'s write has been issued: make it matchable and apply the path's placement budget."""
        self.tree.mark_ready(ck)
        attached = node is self.tree.root or node.parent is not None  # not trimmed away meanwhile
        freed = self.tree.recycle_path(node if attached else ck.node, self.placement)
        self.store.free(freed.handles)

    def _free_request_slot(self, req) -> None:
        if req.kv.holds_mamba:
            self.slots.free([int(req.kv.mamba_pool_idx)])
            req.kv.mamba_pool_idx = None

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._forget(req.rid)
        self._free_request_slot(req)

    # ---------------------------------------------------------------- eviction and sizes
    def _evict_slots(self, n: int) -> int:
        """Free ``n`` mamba-pool slots held by checkpoints (only fp32 checkpoints hold any)."""
        if not self.store.uses_mamba_slots:
            return 0
        return len(self._evict_checkpoint_bytes(n * self.store.slot_bytes).handles)

    def _evict_checkpoint_bytes(self, nbytes: int):
        self._release_finished_pins()
        freed = self.tree.evict(num_bytes=nbytes)
        self.store.free(freed.handles)
        if freed.kv_indices:
            self.token_to_kv_pool_allocator.free(torch.tensor(freed.kv_indices, dtype=torch.int64, device=self._kv_device))
        return freed

    def evict(self, params: EvictParams) -> EvictResult:
        result = EvictResult()
        if params.num_tokens > 0:
            freed = self.tree.evict(num_tokens=params.num_tokens)
            if freed.kv_indices:
                self.token_to_kv_pool_allocator.free(
                    torch.tensor(freed.kv_indices, dtype=torch.int64, device=self._kv_device)
                )
            self.store.free(freed.handles)
            result.num_tokens_evicted = len(freed.kv_indices)
            if self.store.uses_mamba_slots:
                result.mamba_num_evicted += len(freed.handles)
        if params.mamba_num > 0:
            result.mamba_num_evicted += self._evict_slots(params.mamba_num)
        return result

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    full_evictable_size = evictable_size
    full_protected_size = protected_size

    def mamba_evictable_size(self) -> int:
        if not self.store.uses_mamba_slots:
            return 0
        return self.tree.evictable_checkpoint_bytes() // self.store.slot_bytes

    def mamba_protected_size(self) -> int:
        if not self.store.uses_mamba_slots:
            return 0
        return self.tree.checkpoint_count() - self.mamba_evictable_size()

    def total_size(self) -> int:
        return self.tree.total_size()

    def reset(self) -> None:
        # SGLang clears the KV and mamba allocators right after (flush_cache): drop, don't free.
        if hasattr(self, "tree"):
            freed = self.tree.reset()
            if not self.store.uses_mamba_slots:
                self.store.free(freed.handles)  # our own pool: SGLang does not clear it
            self.root_node = self.tree.root
            self._branch_points.clear()
            self._prompt_lens.clear()
            self._matched.clear()
            self._pins.clear()
            self._store_queue = []  # its checkpoints went with the tree; SGLang clears the slots
            RESTORES.clear()
            STASH.clear()

    # ---------------------------------------------------------------- observability
    def stats_dict(self) -> dict:
        self._forget_finished_requests()
        d = self.tree.stats.as_dict()
        d.update(
            tracked_requests=len(self._matched),
            checkpoint_count=self.tree.checkpoint_count(),
            checkpoint_bytes=self.tree.checkpoint_bytes(),
            kv_tokens=self.tree.total_size(),
            # Exported chunk-boundary rows held between a forward and its checkpoints (memory
            # SGLang's planner does not budget), and what keeping the full tensors would pin.
            export_stash_bytes=STASH.stash_bytes(),
            export_stash_peak_bytes=STASH.peak_bytes,
            export_full_peak_bytes=STASH.peak_exported_bytes,
            # quantized hits restored at the forward, batched: average batch = restored / flushes
            deferred_restore_flushes=RESTORES.flushes,
            deferred_restores=RESTORES.restored,
            # quantized stores of exported states: all of a forward's in one launch, claimed per
            # request; the unclaimed ones (a checkpoint was already there) are released
            export_ahead_stored=getattr(self.store, "ahead_stored", 0),
            export_ahead_unclaimed=getattr(self.store, "ahead_unclaimed", 0),
            # quantized stores of running/finishing requests, one launch per scheduler step
            store_flushes=self.store_flushes,
            stores_flushed=self.stores_flushed,
        )
        return d

    def pretty_print(self) -> None:
        print(f"k3 radix cache: {self.stats_dict()}")


def _eviction_policy(hf_config: Optional[dict]) -> EvictionPolicy:
    """Utility = recency + prefill FLOPs saved per byte, priced with the served model's own
    KDA/MLA/MoE dimensions (token counts when the config is not a Kimi-Linear-style one)."""
    if not hf_config or not hf_config.get("linear_attn_config"):
        return EvictionPolicy()
    kv_dtype = "fp32" if str(hf_config.get("torch_dtype", "")).endswith("float32") else "bf16"
    return EvictionPolicy(cost=from_hf_config(hf_config), kv_dtype=kv_dtype)


def _request_namespaced(req) -> bool:
    """Requests in a LoRA / cache-salt namespace are not shared through this tree."""
    return getattr(req, "extra_key", None) is not None or getattr(req, "cache_salt", None) is not None
