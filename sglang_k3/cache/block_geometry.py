"""How the unified memory budget is cut into blocks: torch-free, shared by the server's unified pool
and the trace replay. Which block holds what is :mod:`sglang_k3.cache.block_ledger`'s business.

Block size. A block is sized for the smallest thing that moves, one checkpoint (one int8
checkpoint at 48B is about 12 MB, a fresh fp32 state about 43 MB), not for the active state: a
finer block means that freeing room for a checkpoint empties fewer KV tokens, and that less of a
checkpoint block is padding. Measured on the conversation trace (3,000 requests, 48B, int8), a
block of one active state gave 0.083 / 0.159 token hit rate at 20 / 40 GiB, a block of one
checkpoint 0.089 / 0.174.

KV pages. With SGLang's ``--page-size`` ``p`` over 1, a block holds a whole number of pages
(``kv_per_block`` is a multiple of ``kv_page``), so a page never straddles two blocks and page
``q`` is tokens ``[q * p, (q + 1) * p)`` of block ``q * p // kv_per_block``, the token-major
layout of page 1 unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockGeometry:
    """The budget's layout. ``block_bytes`` is ``kv_per_block`` KV tokens of ``kv_token_bytes``
    (whole pages of ``kv_page`` tokens), holds one active state (``active_bytes``) and is exactly
    ``ckpt_per_block`` checkpoint strides."""

    num_blocks: int
    block_bytes: int
    kv_token_bytes: int
    kv_per_block: int
    active_bytes: int
    ckpt_bytes: int
    ckpt_stride: int
    ckpt_per_block: int
    active_span: int = 1  # blocks one active state spans
    kv_page: int = 1  # tokens per KV page (SGLang's --page-size)

    @property
    def pages_per_block(self) -> int:
        return self.kv_per_block // self.kv_page

    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_slots(self) -> int:
        """Active-state slot indices the buffer has room for (slot 0: padding)."""
        return self.num_blocks // self.active_span

    @property
    def reserved_blocks(self) -> int:
        return self.active_span  # slot 0's span: the padding target of KV token 0, slot 0 and handle 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    def __post_init__(self) -> None:
        if self.block_bytes != self.kv_per_block * self.kv_token_bytes:
            raise ValueError("block_bytes must be kv_per_block * kv_token_bytes")
        if self.kv_page < 1 or self.kv_per_block % self.kv_page:
            raise ValueError(f"a block's {self.kv_per_block} KV tokens must be whole pages of {self.kv_page}")
        if self.active_span < 1 or self.active_bytes > self.active_span * self.block_bytes:
            raise ValueError("active_span blocks must hold one active state")
        if self.ckpt_per_block * self.ckpt_stride > self.block_bytes:
            raise ValueError("a block must hold ckpt_per_block checkpoints")
        if self.ckpt_per_block * self.ckpt_stride != self.block_bytes:
            raise ValueError("checkpoint strides must tile the block exactly")
        if self.ckpt_per_block < 1 or self.ckpt_stride < self.ckpt_bytes:
            raise ValueError("a block must hold at least one checkpoint")


def _fit_block(per: int, kv_token_bytes: int, need: int, align: int, page: int = 1) -> tuple[int, int]:
    """The smallest ``per >=`` the given, a multiple of ``page``, whose block is aligned and splits
    into ``m >= 1`` aligned checkpoint strides of at least ``need`` bytes: ``(per, m)``."""
    per = -(-per // page) * page
    for _ in range(1 << 16):
        block = per * kv_token_bytes
        m = block // need
        if block % align == 0 and m >= 1 and block % (m * align) == 0:
            return per, m
        per += page
    raise ValueError(f"no block size fits KV entries of {kv_token_bytes} B and checkpoints of {need} B")


def plan_geometry(
    budget_bytes: int, *, kv_token_bytes: int, active_bytes: int, ckpt_bytes: int, align: int = 64, kv_page: int = 1
) -> BlockGeometry:
    """Cut ``budget_bytes`` into blocks. A block is a whole number of KV token entries that divides
    into ``ckpt_per_block`` equal, ``align``-aligned checkpoint strides (so every view into the
    buffer is a plain strided tensor and every entry starts aligned); an active state spans
    ``active_span`` blocks. Each span ``k`` from 1 (a block holds a whole state) to
    ``ceil(active / checkpoint)`` (a block holds about one checkpoint) gives the smallest such block
    of at least ``active / k`` bytes; the one kept pads least, counting checkpoint padding in full
    and active-state padding at half (active states are only the running requests' few slots),
    the finer block on a tie. At 48B that is, for int8 checkpoints, a block of one checkpoint and a
    span of 4 (13 % of each active slot is padding, none of a checkpoint), for bf16 a span of 2,
    for fp32 a span of 1. ``kv_page``: SGLang's KV page size; a block holds whole pages."""
    for name, v in (("kv_token_bytes", kv_token_bytes), ("active_bytes", active_bytes), ("ckpt_bytes", ckpt_bytes)):
        if v <= 0:
            raise ValueError(f"{name} must be positive (got {v})")
    need = -(-ckpt_bytes // align) * align
    best = None
    for k in range(1, max(1, -(-active_bytes // ckpt_bytes)) + 1):
        per0 = -(-max(-(-active_bytes // k), min(active_bytes, ckpt_bytes)) // kv_token_bytes)
        per, m = _fit_block(per0, kv_token_bytes, need, align, kv_page)
        block = per * kv_token_bytes
        span = -(-active_bytes // block)
        stride = block // m
        waste = (stride - ckpt_bytes) / stride + (span * block - active_bytes) / (span * block) / 2
        if best is None or (waste, block) < best[0]:
            best = ((waste, block), per, m, span)
    _, per, m, span = best
    block = per * kv_token_bytes
    return BlockGeometry(
        num_blocks=budget_bytes // block,
        block_bytes=block,
        kv_token_bytes=kv_token_bytes,
        kv_per_block=per,
        active_bytes=active_bytes,
        ckpt_bytes=ckpt_bytes,
        ckpt_stride=block // m,
        ckpt_per_block=m,
        active_span=span,
        kv_page=kv_page,
    )
