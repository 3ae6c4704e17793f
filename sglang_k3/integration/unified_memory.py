"""The unified memory budget inside SGLang: one buffer for MLA KV, active KDA states and k3
checkpoints (``--k3-no-unified-memory`` turns it off).

SGLang builds its pools first, sized its own way (``--mem-fraction-static``,
``--max-total-tokens``, ``--max-mamba-cache-size``). :func:`install` (run by
``patches/kv_cache_configurator_init_pools.py`` right after, before any attention backend reads
a pool) takes the bytes SGLang gave the KV pool and the state pool as the budget, builds one
:class:`~sglang_k3.state.unified_buffer.UnifiedBuffer` of that size, points the KV pool's
per-layer buffers and the mamba pool's ``temporal``/``conv`` at views into it (the old tensors are
dropped), and replaces the two allocators with ones that draw blocks from one
:class:`~sglang_k3.cache.block_ledger.BlockLedger`. The k3 cache then puts its checkpoints in the
same buffer (:func:`checkpoint_buffers`).

What SGLang sees (``docs/sglang_cache_contract.md`` §1h for the checks these keep exact):

* KV allocator: ``available_size()`` = free KV tokens + free blocks beyond the active reserve;
  ``size`` = KV blocks held + those, so ``available + cached + in use == size`` holds at all times.
  At ``--page-size`` 1 it is SGLang's token allocator (:class:`UnifiedKVAllocator`); above 1 its
  paged one (:class:`UnifiedPagedKVAllocator`), whose blocks hold whole pages.
* State-slot allocator and ``mamba_pool.size``: the active reserve ``R`` (SGLang's own count of
  request slots); ``available_size() = R - active``; ``schedulable_available_size()`` = the free
  blocks a slot can take now. When short, SGLang asks the cache to evict (``mamba_num``), which
  evicts by value until blocks are free.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.platforms import current_platform
from sglang.srt.utils import get_num_new_pages

from sglang_k3.cache.block_ledger import BlockLedger, LedgerError, plan_geometry
from sglang_k3.config import K3Config
from sglang_k3.state.checkpoint_pool import parse_checkpoint_dtype
from sglang_k3.state.unified_buffer import CheckpointLayout, StateLayout, UnifiedBuffer

logger = logging.getLogger(__name__)


def index_tensor(values, device) -> torch.Tensor:
    """A list of int indices as an int64 tensor on ``device``, through numpy: ``torch.tensor`` of
    a list costs about 55 ns an element on the host (0.22 ms for a 4,000-token prompt's KV),
    numpy about 15. Used wherever a KV allocation, free or tree path becomes a tensor."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


class UnifiedConfigError(ValueError):
    pass


@dataclasses.dataclass
class UnifiedMemory:
    """What :func:`install` built, reached by the k3 cache through the pools
    (:func:`unified_of`)."""

    ledger: BlockLedger
    buffer: UnifiedBuffer
    ckpt_layout: CheckpointLayout


_ATTR = "_k3_unified_memory"


def unified_of(req_to_token_pool) -> Optional[UnifiedMemory]:
    return getattr(req_to_token_pool, _ATTR, None)


class _LedgerKV:
    """What SGLang's two KV allocators share over the unified budget: their capacity counts the
    blocks evicting checkpoints would free (``reclaimable_blocks``, set by the k3 cache), and
    taking KV evicts them when it must (``evict_for_kv``): SGLang admits a prefill only if
    ``available_size()`` plus the tree's evictable KV covers it, and knows nothing of checkpoints,
    so a budget full of checkpoints would otherwise look full to it forever. KV is taken in pages
    (tokens at page 1)."""

    ledger: BlockLedger
    page_size: int

    def _attach(self, ledger: BlockLedger) -> None:
        self.ledger = ledger
        self.reclaimable_blocks: Callable[[], int] = lambda: 0  # set by the k3 cache
        self.evict_for_kv: Optional[Callable[[int], None]] = None  # set by the k3 cache

    def _extra(self) -> int:
        """KV tokens that evicting checkpoints would make allocatable (beyond the reserve)."""
        led = self.ledger
        if not led.ckpt_count():
            return 0
        return self.reclaimable_blocks() * led.geom.kv_per_block

    @property
    def size(self) -> int:
        return self.ledger.kv_capacity() + self._extra()

    @size.setter
    def size(self, _value: int) -> None:
        """The base class assigns it once; the ledger's KV side is the size."""

    def available_size(self) -> int:
        return self.ledger.kv_available() + self._extra()

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: frees reach the ledger at once."""

    def _take_pages(self, n: int) -> Optional[list[int]]:
        """``n`` pages from the ledger, evicting checkpoints by value until their blocks are free
        when SGLang was told eviction would make the room; None when it cannot."""
        got = self.ledger.kv_alloc_pages(n)
        if got is None and self.evict_for_kv is not None and n * self.page_size <= self.available_size():
            self.evict_for_kv(n * self.page_size)
            got = self.ledger.kv_alloc_pages(n)
        return got


class UnifiedKVAllocator(_LedgerKV, TokenToKVPoolAllocator):
    """SGLang's page-1 KV allocator, drawing tokens from the unified budget's KV blocks."""

    def __init__(self, ledger: BlockLedger, dtype: torch.dtype, device, kvcache) -> None:
        self._attach(ledger)
        # the base sets page_size, dtype, device, the KV cache and the free-group state
        super(TokenToKVPoolAllocator, self).__init__(0, 1, dtype, device, kvcache, False)

    def clear(self) -> None:
        self.ledger.clear()  # SGLang clears both allocators at a flush, after the cache's reset
        self.free_group = None

    def alloc(self, need_size: int):
        got = self._take_pages(need_size)  # at page 1 a page is a token
        if got is None:
            return None
        return index_tensor(got, self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self.ledger.kv_free(free_index.tolist())

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self.free(page_ids)


class UnifiedPagedKVAllocator(_LedgerKV, PagedTokenToKVPoolAllocator):
    """SGLang's paged KV allocator (``--page-size`` over 1), drawing whole pages from the unified
    budget's KV blocks (a block holds ``pages_per_block`` pages; page ``q`` is tokens
    ``[q * p, (q + 1) * p)``). SGLang's own ``alloc_extend`` / ``alloc_decode`` place the tokens
    (the Triton kernels on a GPU, the torch ones on CPU): before each, exactly the pages the batch
    needs are taken from the ledger and handed to them as the free list, so the free list is
    always empty between calls and the ledger is the only record of which page is free."""

    def __init__(self, ledger: BlockLedger, page_size: int, dtype: torch.dtype, device, kvcache) -> None:
        if ledger.geom.kv_page != page_size:
            raise UnifiedConfigError(
                f"sglang-k3 unified memory: the ledger's blocks hold pages of {ledger.geom.kv_page} tokens, "
                f"SGLang's allocator pages of {page_size}"
            )
        self._attach(ledger)
        # the base sets page_size, dtype, device, the KV cache and the free-group state; the paged
        # constructor's page table (num_pages, free_pages) is the ledger here
        BaseTokenToKVPoolAllocator.__init__(self, 0, page_size, dtype, device, kvcache, False)
        self.debug_mode = False
        self.use_triton_kernels = current_platform.capabilities.supports_triton  # as SGLang's own decides
        self.clear()

    def clear(self) -> None:
        self.ledger.clear()
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group = []
        self.staged_pages = []
        self.num_staged_pages = 0

    def _lend(self, pages: list[int]) -> None:
        """Hand ``pages`` to SGLang's placement code as its free list, which takes exactly them."""
        self.free_pages = index_tensor(pages, self.device)

    def alloc(self, need_size: int):
        if need_size % self.page_size:
            raise ValueError(f"the paged KV allocator hands out whole pages of {self.page_size} (asked {need_size})")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        if not pages:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        ids = index_tensor(pages, self.device)
        return (ids[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def alloc_extend(
        self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages=None
    ):
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        pages = self._take_pages(int(num_new_pages))
        if pages is None:
            return None
        self._lend(pages)
        out = super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        assert out is not None and len(self.free_pages) == 0, "SGLang's placement did not take the pages it was lent"
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        n = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        pages = self._take_pages(n)
        if pages is None:
            return None
        self._lend(pages)
        out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        assert out is not None and len(self.free_pages) == 0, "SGLang's placement did not take the pages it was lent"
        return out

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        ids = torch.cat(page_ids) if len(page_ids) > 1 else page_ids[0]
        self.ledger.kv_free_pages(ids.tolist())

    def get_all_free_pages(self):
        """None: the free pages are the ledger's (SGLang's leak census skips pools without a list)."""
        return None


class UnifiedSlotAllocator(MambaSlotAllocator):
    """SGLang's state-slot allocator: a slot is ``active_span`` blocks of the unified budget's
    active region."""

    def __init__(self, ledger: BlockLedger, device) -> None:
        self.ledger = ledger
        self.evict_blocks: Optional[Callable[[int], None]] = None  # set by the k3 cache
        super().__init__(ledger.active_reserve, device)

    @property
    def free_slots(self) -> torch.Tensor:
        """Free blocks (diagnostics only)."""
        return torch.tensor(self.ledger.free_block_list(), dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        self.ledger.clear()

    def available_size(self) -> int:
        return self.ledger.active_reserve - self.ledger.active_count()

    def schedulable_available_size(self) -> int:
        want = self.available_size()
        return self.ledger.free_slots(limit=max(0, want))

    def _do_alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size > self.schedulable_available_size():
            return None
        got = [self.ledger.active_alloc() for _ in range(need_size)]
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        got = super().alloc(need_size)
        if got is None and self.evict_blocks is not None:
            # until need_size slots are free: the checkpoints borrowing region slots go, else KV
            # and checkpoints elsewhere, by value (never live data: only the tree's unlocked)
            self.evict_blocks(need_size)
            got = self._do_alloc(need_size)
        if got is None and self.ledger.free_slots(limit=need_size) >= need_size:
            # More states live than the region holds: a borrower that cannot go (a pinned hit)
            # keeps a slot, or the reserve is capped below SGLang's rows by its state pool. Free
            # blocks hold them; SGLang would otherwise stop the server on its allocation assertion.
            got = torch.tensor(
                [self.ledger.active_alloc() for _ in range(need_size)], dtype=torch.int64, device=self.device
            )
            self.ledger.counters.active_overflows += need_size
            logger.warning(
                "sglang-k3 unified memory: %d state slot(s) beyond the reserve of %d, from free memory",
                need_size,
                self.ledger.active_reserve,
            )
        if got is None:
            led = self.ledger
            logger.error(
                "sglang-k3 unified memory: no state slot for %d request(s): %d of %d reserved slots held by "
                "running requests; the rest of the region is held by checkpoints that cannot go now (pinned by a "
                "hit, or their copy has not landed), and no run of %d free blocks is left elsewhere. Blocks: %s",
                need_size,
                led.active_count(),
                led.active_reserve,
                led.span,
                led.block_map(),
            )
        return got

    def free(self, free_index: torch.Tensor) -> None:
        for b in free_index.reshape(-1).tolist():
            self.ledger.active_free(int(b))


def mla_pool_of(token_to_kv_pool):
    full = getattr(token_to_kv_pool, "full_kv_pool", None)
    if full is None or not hasattr(full, "kv_buffer") or not hasattr(full, "kv_lora_rank"):
        return None
    return full


def plan(cfg: K3Config, kv_pool, mamba_pool, max_running: int, page: int = 1):
    """Size the budget as SGLang sized its two pools and check the floors fit. The active reserve
    is SGLang's count of request rows (capped by its state pool): a request holds a state only
    while it holds a row, under the overlap scheduler too (``docs/sglang_cache_contract.md`` §6).
    Checkpoints borrow the region while it is free and go, by value, when a state needs it back;
    when one cannot go (a pinned hit), the state takes free blocks elsewhere (``active_overflows``).
    An earlier reserve of two slots per row under overlap held a quarter of the live A/B's pressure
    budget that KV could never use (peak states: 4 of the 8 held back)."""
    state = StateLayout.of_mamba_cache(mamba_pool.mamba_cache)
    ckpt = CheckpointLayout.of_state(state, parse_checkpoint_dtype(cfg.checkpoint_dtype))
    kv_token_bytes = sum(b[0].numel() * b.element_size() for b in kv_pool.kv_buffer)
    kv_bytes = sum(b.numel() * b.element_size() for b in kv_pool.kv_buffer)
    state_bytes = mamba_pool.mamba_cache.temporal.numel() * mamba_pool.mamba_cache.temporal.element_size() + sum(
        c.numel() * c.element_size() for c in mamba_pool.mamba_cache.conv
    )
    geom = plan_geometry(
        kv_bytes + state_bytes,
        kv_token_bytes=kv_token_bytes,
        active_bytes=state.nbytes,
        ckpt_bytes=ckpt.nbytes,
        kv_page=page,
    )
    reserve = max(1, min(int(mamba_pool.size), int(max_running)))
    span = geom.active_span
    need = {
        f"the padding target ({span} blocks)": span,
        f"{reserve} active KDA state slots of {span} blocks": reserve * span,
        f"one block of MLA KV ({geom.kv_per_block} tokens)": 1,
    }
    if cfg.min_kv_tokens:
        need[f"--k3-min-kv-tokens {cfg.min_kv_tokens}"] = max(0, -(-cfg.min_kv_tokens // geom.kv_per_block) - 1)
    if cfg.min_checkpoints:
        need[f"--k3-min-checkpoints {cfg.min_checkpoints}"] = -(-cfg.min_checkpoints // geom.ckpt_per_block)
    if sum(need.values()) > geom.num_blocks:
        parts = ", ".join(f"{k}: {v}" for k, v in need.items())
        raise UnifiedConfigError(
            f"sglang-k3 unified memory: the budget of {geom.budget_bytes} bytes (SGLang's KV pool {kv_bytes} B + "
            f"state pool {state_bytes} B) holds {geom.num_blocks} blocks of {geom.block_bytes} B, but needs "
            f"{sum(need.values())} ({parts}). Raise --max-total-tokens or --mem-fraction-static, lower the floors, "
            "or lower --max-running-requests."
        )
    try:
        ledger = BlockLedger(
            geom, active_reserve=reserve, min_kv_tokens=cfg.min_kv_tokens, max_checkpoints=cfg.max_checkpoints
        )
    except LedgerError as e:
        raise UnifiedConfigError(f"sglang-k3 unified memory: {e}") from None
    sizes = {"sglang_kv_pool_bytes": kv_bytes, "sglang_state_pool_bytes": state_bytes}
    return ledger, state, ckpt, sizes


def install(cfg: K3Config, req_to_token_pool, token_to_kv_pool, allocator):
    """Rebuild the KV and state pools over one buffer; returns the new KV allocator, or None when
    this configuration has no unified pool (not an MLA + KDA hybrid)."""
    kv_pool = mla_pool_of(token_to_kv_pool)
    mamba_pool = getattr(req_to_token_pool, "mamba_pool", None)
    if kv_pool is None or mamba_pool is None:
        logger.info("sglang-k3 unified memory: not an MLA + KDA hybrid; pools left as SGLang built them")
        return None
    page = int(getattr(allocator, "page_size", 1))
    ledger, state, ckpt, sizes = plan(cfg, kv_pool, mamba_pool, max_running=req_to_token_pool.size, page=page)
    g = ledger.geom
    n_layers, dim = len(kv_pool.kv_buffer), kv_pool.kv_buffer[0].shape[-1]
    kv_dtype, device = kv_pool.kv_buffer[0].dtype, kv_pool.kv_buffer[0].device
    # Drop SGLang's tensors before the buffer that replaces them exists: on a GPU the budget is
    # most of the device, and holding both would not fit.
    kv_pool.kv_buffer = []
    mamba_pool.mamba_cache = dataclasses.replace(mamba_pool.mamba_cache, temporal=torch.empty(0), conv=[])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    buf = UnifiedBuffer(g, device=device)
    kv_pool.kv_buffer = buf.kv_layer_views(n_layers, dim, kv_dtype)
    kv_pool.size = g.num_blocks * g.kv_per_block - kv_pool.page_size
    token_to_kv_pool.size = kv_pool.size
    if hasattr(kv_pool, "data_ptrs"):
        kv_pool.data_ptrs = torch.tensor(
            [x.data_ptr() for x in kv_pool.kv_buffer], dtype=kv_pool.data_ptrs.dtype, device=kv_pool.data_ptrs.device
        )
    temporal, conv = buf.state_views(state)
    mamba_pool.mamba_cache = dataclasses.replace(
        mamba_pool.mamba_cache, temporal=temporal, conv=[] if conv is None else [conv]
    )
    mamba_pool.size = ledger.active_reserve
    drop_cached_views(mamba_pool)
    slots = UnifiedSlotAllocator(ledger, device=temporal.device)
    req_to_token_pool.mamba_allocator = slots
    if page == 1:
        new_alloc = UnifiedKVAllocator(ledger, allocator.dtype, allocator.device, allocator.get_kvcache())
    else:
        new_alloc = UnifiedPagedKVAllocator(ledger, page, allocator.dtype, allocator.device, allocator.get_kvcache())
    describe_for_transfer(token_to_kv_pool, kv_pool, mamba_pool, buf)
    setattr(req_to_token_pool, _ATTR, UnifiedMemory(ledger, buf, ckpt))
    logger.info(
        "sglang-k3 unified memory: %d bytes (SGLang's KV pool %d B + state pool %d B) in %d blocks of %d B "
        "(%d KV tokens in pages of %d, or %d %s checkpoints each; a state spans %d); %d state slots held back "
        "for active states",
        g.budget_bytes,
        sizes["sglang_kv_pool_bytes"],
        sizes["sglang_state_pool_bytes"],
        g.num_blocks,
        g.block_bytes,
        g.kv_per_block,
        g.kv_page,
        g.ckpt_per_block,
        cfg.checkpoint_dtype,
        g.active_span,
        ledger.active_reserve,
    )
    return new_alloc


def describe_for_transfer(token_to_kv_pool, kv_pool, mamba_pool, buf: UnifiedBuffer) -> None:
    """Tell SGLang's PD transfer (``--disaggregation-mode``) where the unified buffer keeps KV and
    states, the way its own unified pool does (``UnifiedMambaPool`` /
    ``UnifiedMLATokenToKVPool.get_contiguous_buf_infos`` in 0.5.23): one registered region, the
    whole buffer, and one transfer entry per kind, addressed ``base + index * item_len``.

    * **KV**: KV is token-major (every MLA layer's row of token ``t`` at ``t * kv_token_bytes``),
      so page ``p`` is ``page_size * kv_token_bytes`` contiguous bytes: one entry with that item
      length moves all layers of a page at once.
    * **State**: slot ``s`` is ``active_span`` blocks from ``s * span * block_bytes``: one entry
      with the slot stride as its item moves every KDA layer's recurrent and conv state at once.

    SGLang's per-layer description (a pointer and a contiguous length per layer view) gave
    overlapping regions over this buffer, which Mooncake refused, so every transfer failed. Both
    peers must run the k3 cache with unified memory and the same model and ``--page-size``:
    Mooncake's own checks then compare the item lengths (a state of another size is refused
    there; SGLang compares KV page sizes at bootstrap)."""
    g = buf.geom
    base, total = buf.raw.data_ptr(), buf.raw.numel()
    kv_item = int(getattr(kv_pool, "page_size", 1)) * g.kv_token_bytes
    state_item = g.active_span * g.block_bytes
    first_layer = list(getattr(token_to_kv_pool, "full_attention_layer_id_mapping", None) or [0])[:1]

    # the hybrid pool hands both questions to these (HybridLinearKVPool.get_contiguous_buf_infos
    # asks its full_kv_pool); one entry, so one layer id: the peers pair entries by id
    kv_pool.get_contiguous_buf_infos = lambda: ([base], [total], [kv_item])
    token_to_kv_pool.get_kv_layer_ids = lambda: list(first_layer)
    mamba_pool.get_contiguous_buf_infos = lambda: ([base], [total], [state_item])
    # A whole-slot envelope has no per-tensor dims, layer ids or shard groups: it cannot be
    # TP-resliced (as SGLang's own unified pool), so both sides run the same attention TP.
    for name in (
        "get_state_dim_per_tensor",
        "get_state_layer_ids",
        "get_state_slice_outer_counts",
        "get_state_conv_shard_groups",
    ):
        setattr(mamba_pool, name, lambda: [])


def drop_cached_views(pool) -> list[str]:
    """Forget every ``functools.cached_property`` value ``pool`` computed from the tensors it held
    before :func:`install` replaced them; each is recomputed from the views on its next use.
    Returns the names dropped.

    SGLang's ``MambaPool`` warms its fused conv-slot kernels in its constructor and caches, per
    instance, whether they may run (``_conv_fuse_ok``: contiguous bf16 conv) and their table of base
    pointers and strides (``_conv_slot_desc``). Kept after the swap, both describe the conv tensor
    just freed: on the H200 every new request's slot clear (``clear_slots``) then wrote zeros at the
    old pointer, which raised an illegal memory access at the first request when that memory had
    been returned to the driver (``--mem-fraction-static 0.12``, no ``--max-total-tokens``), and
    otherwise wrote into whatever reused it. Recomputed, ``_conv_fuse_ok`` is False on the unified
    conv view (strided, not contiguous), and SGLang clears with ``index_fill_`` on the view."""
    dropped = []
    for klass in type(pool).__mro__:
        for name, attr in vars(klass).items():
            if isinstance(attr, functools.cached_property) and name in pool.__dict__:
                del pool.__dict__[name]
                dropped.append(name)
    return dropped


def checkpoint_buffers(um: UnifiedMemory):
    return um.buffer.checkpoint_views(um.ckpt_layout)
