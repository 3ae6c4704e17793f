"""Who owns which block of the unified memory budget: torch-free, shared by the server's unified
pool (:mod:`sglang_k3.state.unified_buffer`, :mod:`sglang_k3.integration.unified_memory`) and
the trace replay.

The budget is one byte buffer cut into ``num_blocks`` equal blocks. Every block is, at any time,
exactly one of:

* ``FREE``;
* ``RESERVED``: block 0, the dummy write target of padded tokens and padded state slots;
* ``KV``: ``kv_per_block`` MLA KV token entries (token ``t`` lives in block ``t // kv_per_block``);
* ``ACTIVE``: one request's private, full-precision KDA state (state slot ``b`` *is* block ``b``);
* ``CKPT``: ``ckpt_per_block`` checkpoint sub-slots (handle ``h`` lives in block
  ``h // ckpt_per_block``).

The three index spaces alias the same bytes; the ledger guarantees that an index is handed out
only while its block belongs to that kind, so live allocations never overlap and every byte is
accounted to exactly one kind.

Fragmentation. A block returns to ``FREE`` only when nothing of its kind is left in it: a KV
block when all its tokens are free, a checkpoint block when all its sub-slots are free, an active
block when its request releases it. Three rules keep that from stranding memory:

1. *Packing.* New KV tokens and checkpoints go into the partly used block of their kind with the
   fewest free entries first (best fit), so partly used blocks fill up and emptying ones drain.
2. *Two ends.* A kind that needs a fresh block takes the free block nearest its end of the
   buffer (KV from the low end, states from the high end), so free blocks gather in the middle
   and the largest free run stays long.
3. *Eviction until a block frees.* When a kind needs a block and none is free, the cache evicts
   the least valuable KV and checkpoints, priced alike in prefill FLOPs saved per byte, until a
   block empties (:meth:`sglang_k3.cache.lifecycle.CacheLifecycle.evict_until`); the bytes that
   took are counted (``reclaim_evicted_bytes``).

Active slots have a reserve: ``active_reserve`` blocks (SGLang's own count of mamba slots) that KV
never takes, so a request can always get a state slot. Checkpoints may borrow reserve blocks (a
checkpoint is evictable); an active slot that finds no free block evicts them back.

After a flush (:meth:`clear`) every block but the reserved one is free and the largest free run
is the whole budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional


class Kind(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    KV = 2
    ACTIVE = 3
    CKPT = 4


@dataclass(frozen=True)
class BlockGeometry:
    """The budget's layout. ``block_bytes`` is a multiple of ``kv_token_bytes``, holds one active
    state (``active_bytes``) and is exactly ``ckpt_per_block`` checkpoint strides."""

    num_blocks: int
    block_bytes: int
    kv_token_bytes: int
    kv_per_block: int
    active_bytes: int
    ckpt_bytes: int
    ckpt_stride: int
    ckpt_per_block: int

    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1  # block 0 is the padding target

    def __post_init__(self) -> None:
        if self.block_bytes != self.kv_per_block * self.kv_token_bytes:
            raise ValueError("block_bytes must be kv_per_block * kv_token_bytes")
        if self.active_bytes > self.block_bytes or self.ckpt_per_block * self.ckpt_stride > self.block_bytes:
            raise ValueError("a block must hold one active state and ckpt_per_block checkpoints")
        if self.ckpt_per_block * self.ckpt_stride != self.block_bytes:
            raise ValueError("checkpoint strides must tile the block exactly")
        if self.ckpt_per_block < 1 or self.ckpt_stride < self.ckpt_bytes:
            raise ValueError("a block must hold at least one checkpoint")


def plan_geometry(
    budget_bytes: int, *, kv_token_bytes: int, active_bytes: int, ckpt_bytes: int, align: int = 64
) -> BlockGeometry:
    """Cut ``budget_bytes`` into blocks. A block is the smallest whole number of KV token entries
    that holds one active state and divides into ``ckpt_per_block`` equal, ``align``-aligned
    checkpoint strides (so every view into the buffer is a plain strided tensor and every entry
    starts aligned)."""
    for name, v in (("kv_token_bytes", kv_token_bytes), ("active_bytes", active_bytes), ("ckpt_bytes", ckpt_bytes)):
        if v <= 0:
            raise ValueError(f"{name} must be positive (got {v})")
    per = -(-active_bytes // kv_token_bytes)
    need = -(-ckpt_bytes // align) * align
    for _ in range(1 << 16):
        block = per * kv_token_bytes
        m = block // need
        if block % align == 0 and m >= 1 and block % (m * align) == 0:
            break
        per += 1
    else:
        raise ValueError(f"no block size fits KV entries of {kv_token_bytes} B and checkpoints of {ckpt_bytes} B")
    return BlockGeometry(
        num_blocks=budget_bytes // block,
        block_bytes=block,
        kv_token_bytes=kv_token_bytes,
        kv_per_block=per,
        active_bytes=active_bytes,
        ckpt_bytes=ckpt_bytes,
        ckpt_stride=block // m,
        ckpt_per_block=m,
    )


class LedgerError(RuntimeError):
    pass


@dataclass
class LedgerCounters:
    blocks_to_kv: int = 0  # block handovers, by the kind that took the block
    blocks_to_active: int = 0
    blocks_to_ckpt: int = 0
    peak_kv_blocks: int = 0
    peak_ckpt_blocks: int = 0
    peak_active_blocks: int = 0
    reclaims: int = 0  # shortages met by evicting (evict_until calls that evicted something)
    reclaim_evicted_bytes: int = 0  # bytes those evictions freed (KV + checkpoints)


class BlockLedger:
    def __init__(self, geom: BlockGeometry, active_reserve: int, min_kv_tokens: int = 0, max_checkpoints: int = 0):
        """``min_kv_tokens``: checkpoints never take a block KV would need to reach that many
        tokens (a KV floor). ``max_checkpoints``: a cap on live checkpoints (0: none)."""
        if geom.usable_blocks < 2:
            raise LedgerError(
                f"the memory budget holds {geom.num_blocks} blocks of {geom.block_bytes} bytes; it needs at "
                "least 3 (the padding block, one KDA state slot and one block of MLA KV)"
            )
        self.geom = geom
        self.active_reserve = max(0, min(active_reserve, geom.usable_blocks - 1))
        self.min_kv_tokens = min_kv_tokens
        self.max_checkpoints = max_checkpoints
        self.counters = LedgerCounters()
        self.clear()

    # ------------------------------------------------------------------ state
    def note_reclaim(self, checkpoint_bytes: int, kv_entries: int) -> None:
        """Count what one shortage cost in evictions (called by whoever ran the eviction)."""
        if checkpoint_bytes or kv_entries:
            self.counters.reclaims += 1
            self.counters.reclaim_evicted_bytes += checkpoint_bytes + kv_entries * self.geom.kv_token_bytes

    def clear(self) -> None:
        """Everything free (a flush): the allocators above are cleared with it."""
        g = self.geom
        self.kind = [Kind.FREE] * g.num_blocks
        self.kind[0] = Kind.RESERVED
        self._free = set(range(1, g.num_blocks))
        self._kv_free: dict[int, list[int]] = {}  # KV block -> free token offsets (a stack)
        self._kv_used: dict[int, bytearray] = {}  # KV block -> 1 where the token is allocated
        self._kv_free_total = 0
        self._kv_partial: set[int] = set()  # KV blocks with at least one free token
        self._ck_partial: set[int] = set()  # checkpoint blocks with at least one free sub-slot
        self._ck_free: dict[int, set[int]] = {}  # checkpoint block -> free sub-slots
        self._active: set[int] = set()
        self._ckpt_live = 0

    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_of(self, kind: Kind) -> int:
        if kind == Kind.KV:
            return len(self._kv_free)
        if kind == Kind.CKPT:
            return len(self._ck_free)
        if kind == Kind.ACTIVE:
            return len(self._active)
        if kind == Kind.FREE:
            return len(self._free)
        return 1

    def active_count(self) -> int:
        return len(self._active)

    def reserve_left(self) -> int:
        """Free blocks held back for active slots not yet taken."""
        return max(0, self.active_reserve - len(self._active))

    def _take_block(self, kind: Kind) -> Optional[int]:
        if not self._free:
            return None
        b = min(self._free) if kind == Kind.KV else max(self._free)
        self._free.remove(b)
        self.kind[b] = kind
        c = self.counters
        if kind == Kind.KV:
            c.blocks_to_kv += 1
            c.peak_kv_blocks = max(c.peak_kv_blocks, len(self._kv_free) + 1)
        elif kind == Kind.CKPT:
            c.blocks_to_ckpt += 1
            c.peak_ckpt_blocks = max(c.peak_ckpt_blocks, len(self._ck_free) + 1)
        else:
            c.blocks_to_active += 1
            c.peak_active_blocks = max(c.peak_active_blocks, len(self._active) + 1)
        return b

    def _give_back(self, b: int) -> None:
        self.kind[b] = Kind.FREE
        self._free.add(b)

    # ------------------------------------------------------------------ KV tokens
    def kv_free_tokens(self) -> int:
        return self._kv_free_total

    def kv_blocks_takeable(self) -> int:
        """Free blocks KV may take now (the active reserve is not KV's)."""
        return max(0, len(self._free) - self.reserve_left())

    def kv_available(self) -> int:
        """KV tokens allocatable without evicting anything."""
        return self.kv_free_tokens() + self.kv_blocks_takeable() * self.geom.kv_per_block

    def kv_capacity(self) -> int:
        """KV tokens held + allocatable now: the KV side's current size."""
        return (len(self._kv_free) + self.kv_blocks_takeable()) * self.geom.kv_per_block

    def kv_alloc(self, n: int) -> Optional[list[int]]:
        """``n`` token indices, or None (nothing taken) when fewer are available."""
        if n <= 0:
            return []
        if n > self.kv_available():
            return None
        per = self.geom.kv_per_block
        out: list[int] = []
        for b in sorted(self._kv_partial, key=lambda b: (len(self._kv_free[b]), b)):  # best fit
            free, used = self._kv_free[b], self._kv_used[b]
            take = min(len(free), n - len(out))
            if take == len(free):
                self._kv_partial.discard(b)
            offs = free[len(free) - take :]
            del free[len(free) - take :]
            for off in offs:
                used[off] = 1
            out.extend(b * per + off for off in offs)
            self._kv_free_total -= take
            if len(out) == n:
                return out
        while len(out) < n:
            b = self._take_block(Kind.KV)
            assert b is not None
            take = min(per, n - len(out))
            out.extend(b * per + i for i in range(take))
            self._kv_free[b] = list(range(per - 1, take - 1, -1))
            self._kv_used[b] = bytearray(take) + bytearray(per - take)
            self._kv_used[b][:take] = b"\x01" * take
            self._kv_free_total += per - take
            if take < per:
                self._kv_partial.add(b)
        return out

    def kv_free(self, indices: Iterable[int]) -> None:
        per = self.geom.kv_per_block
        touched = set()
        for t in indices:
            b, off = divmod(int(t), per)
            used = self._kv_used.get(b)
            if used is None or not used[off]:
                raise LedgerError(f"KV token {t} is not allocated (block {b} is {self.kind[b].name})")
            used[off] = 0
            self._kv_free[b].append(off)
            self._kv_partial.add(b)
            self._kv_free_total += 1
            touched.add(b)
        for b in touched:
            if len(self._kv_free[b]) == per:
                del self._kv_free[b], self._kv_used[b]
                self._kv_partial.discard(b)
                self._kv_free_total -= per
                self._give_back(b)

    # ------------------------------------------------------------------ active slots
    def active_alloc(self) -> Optional[int]:
        b = self._take_block(Kind.ACTIVE)
        if b is not None:
            self._active.add(b)
        return b

    def active_free(self, b: int) -> None:
        if b not in self._active:
            raise LedgerError(f"state slot {b} is not an active slot (block is {self.kind[b].name})")
        self._active.remove(b)
        self._give_back(b)

    # ------------------------------------------------------------------ checkpoints
    def ckpt_at_cap(self) -> bool:
        return bool(self.max_checkpoints) and self.ckpt_count() >= self.max_checkpoints

    def _ckpt_may_take_block(self) -> bool:
        if not self._free:
            return False
        if self.min_kv_tokens:
            loses = self.geom.kv_per_block if len(self._free) > self.reserve_left() else 0
            if self.kv_capacity() - loses < self.min_kv_tokens:
                return False
        return True

    def ckpt_has_room(self) -> bool:
        """Whether :meth:`ckpt_alloc` would succeed now."""
        if self.ckpt_at_cap():
            return False
        return bool(self._ck_partial) or self._ckpt_may_take_block()

    def ckpt_alloc(self) -> Optional[int]:
        if not self.ckpt_has_room():
            return None
        m = self.geom.ckpt_per_block
        if self._ck_partial:
            b = min(self._ck_partial, key=lambda b: (len(self._ck_free[b]), -b))
        else:
            b = self._take_block(Kind.CKPT)
            assert b is not None
            self._ck_free[b] = set(range(m))
            self._ck_partial.add(b)
        free = self._ck_free[b]
        sub = min(free)
        free.remove(sub)
        if not free:
            self._ck_partial.discard(b)
        self._ckpt_live += 1
        return b * m + sub

    def ckpt_free(self, h: int) -> None:
        m = self.geom.ckpt_per_block
        b, sub = divmod(int(h), m)
        free = self._ck_free.get(b)
        if free is None or sub in free:
            raise LedgerError(f"checkpoint {h} is not allocated (block {b} is {self.kind[b].name})")
        free.add(sub)
        self._ck_partial.add(b)
        self._ckpt_live -= 1
        if len(free) == m:
            del self._ck_free[b]
            self._ck_partial.discard(b)
            self._give_back(b)

    def ckpt_free_count(self) -> int:
        """Checkpoints allocatable now without evicting anything."""
        if self.ckpt_at_cap():
            return 0
        part = sum(len(self._ck_free[b]) for b in self._ck_partial)
        more = self.geom.ckpt_per_block * len(self._free) if self._ckpt_may_take_block() else 0
        n = part + more
        return min(n, self.max_checkpoints - self.ckpt_count()) if self.max_checkpoints else n

    def ckpt_count(self) -> int:
        return self._ckpt_live

    def block_of_checkpoint(self, ck) -> int:
        """For eviction by block: the block a tree checkpoint's (first) handle lives in."""
        return ck.handles[0] // self.geom.ckpt_per_block

    # ------------------------------------------------------------------ reporting
    def bytes_by_kind(self) -> dict[str, int]:
        """The split: bytes held by each kind (whole blocks; ``*_used`` counts live entries)."""
        g = self.geom
        return {
            "kv_bytes": len(self._kv_free) * g.block_bytes,
            "kv_used_bytes": (len(self._kv_free) * g.kv_per_block - self.kv_free_tokens()) * g.kv_token_bytes,
            "active_bytes": len(self._active) * g.block_bytes,
            "checkpoint_bytes": len(self._ck_free) * g.block_bytes,
            "checkpoint_used_bytes": self.ckpt_count() * g.ckpt_stride,
            "free_bytes": len(self._free) * g.block_bytes,
            "reserved_bytes": g.block_bytes,
        }

    def largest_free_run(self) -> int:
        """Bytes in the longest run of consecutive free blocks."""
        best = run = 0
        for k in self.kind:
            run = run + 1 if k == Kind.FREE else 0
            best = max(best, run)
        return best * self.geom.block_bytes

    def check(self) -> None:
        """Every block is one kind, and the per-kind tables agree with it."""
        seen = {b: Kind.KV for b in self._kv_free}
        for table, kind in ((self._ck_free, Kind.CKPT), (self._active, Kind.ACTIVE), (self._free, Kind.FREE)):
            for b in table:
                if b in seen:
                    raise LedgerError(f"block {b} is both {seen[b].name} and {kind.name}")
                seen[b] = kind
        for b, k in enumerate(self.kind):
            if b == 0:
                if k != Kind.RESERVED or b in seen:
                    raise LedgerError("block 0 must stay reserved")
                continue
            if seen.get(b) != k:
                raise LedgerError(f"block {b}: kind {k.name}, tables say {seen.get(b)}")
        total = 0
        for b, s in self._kv_free.items():
            used = self._kv_used[b]
            if len(s) >= self.geom.kv_per_block or sorted(s) != [i for i, u in enumerate(used) if not u]:
                raise LedgerError(f"KV block {b}: free list and usage map disagree, or it is empty but not free")
            total += len(s)
        if total != self._kv_free_total:
            raise LedgerError("KV free-token count is off")
        if self._kv_partial != {b for b, f in self._kv_free.items() if f}:
            raise LedgerError("the set of partly free KV blocks is off")
        m = self.geom.ckpt_per_block
        for b, s in self._ck_free.items():
            if len(s) >= m:
                raise LedgerError(f"checkpoint block {b} is empty but not free")
        if self._ckpt_live != sum(m - len(s) for s in self._ck_free.values()):
            raise LedgerError("live checkpoint count is off")
        if self._ck_partial != {b for b, f in self._ck_free.items() if f}:
            raise LedgerError("the set of partly free checkpoint blocks is off")
