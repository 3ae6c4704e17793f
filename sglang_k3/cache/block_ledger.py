"""Who owns which block of the unified memory budget: torch-free, shared by the server's unified
pool (:mod:`sglang_k3.state.unified_buffer`, :mod:`sglang_k3.integration.unified_memory`) and
the trace replay.

The budget is one byte buffer cut into ``num_blocks`` equal blocks. Every block is, at any time,
exactly one of:

* ``FREE``;
* ``RESERVED``: block 0, the dummy write target of padded tokens and padded state slots;
* ``KV``: ``kv_per_block`` MLA KV token entries in whole pages of ``kv_page`` tokens (SGLang's
  ``--page-size``; token ``t`` lives in block ``t // kv_per_block``, page ``t // kv_page``); KV
  is handed out and given back a page at a time;
* ``ACTIVE``: part of one request's private, full-precision KDA state. A state spans
  ``active_span`` consecutive blocks: state slot ``s`` *is* blocks ``[s * span, (s + 1) * span)``;
* ``CKPT``: ``ckpt_per_block`` checkpoint sub-slots (handle ``h`` lives in block
  ``h // ckpt_per_block``).

Blocks are cut by :func:`~sglang_k3.cache.block_geometry.plan_geometry`, which says why they
are sized as they are.

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

Active slots have a region: the top ``active_reserve`` slots (SGLang's own count of mamba slots,
``active_span`` blocks each, aligned) that KV never takes, so a request can always get a state
slot. Checkpoints may borrow region blocks when no other block is free (a checkpoint is
evictable); an active slot that finds no whole free slot evicts the checkpoints of the slot that
holds the fewest (:meth:`BlockLedger.active_victims`). When those cannot go (pinned: the hit being
restored may sit in the last free slot), a state takes any aligned run of free blocks elsewhere.

After a flush (:meth:`clear`) every block but the reserved ones (slot 0's span, the padding target)
is free and the largest free run is the whole rest of the budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Iterator, Optional

from sglang_k3.cache.block_geometry import BlockGeometry, plan_geometry

__all__ = ["BlockGeometry", "BlockLedger", "Kind", "LedgerCounters", "LedgerError", "plan_geometry"]


class Kind(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    KV = 2
    ACTIVE = 3
    CKPT = 4


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
    active_overflows: int = 0  # state slots handed out beyond the active reserve (from free blocks)


class BlockLedger:
    def __init__(self, geom: BlockGeometry, active_reserve: int, min_kv_tokens: int = 0, max_checkpoints: int = 0):
        """``min_kv_tokens``: checkpoints never take a block KV would need to reach that many
        tokens (a KV floor). ``max_checkpoints``: a cap on live checkpoints (0: none)."""
        span = geom.active_span
        if geom.usable_blocks < span + 1:
            raise LedgerError(
                f"the memory budget holds {geom.num_blocks} blocks of {geom.block_bytes} bytes; it needs at "
                f"least {2 * span + 1} (the padding target and one KDA state slot, {span} blocks each, and one "
                "block of MLA KV)"
            )
        self.geom = geom
        self.span = span
        # the active region: the top slots, never KV's; one block outside it is left for KV
        self.active_reserve = max(0, min(active_reserve, (geom.num_blocks - span - 1) // span))
        top = geom.num_slots
        self.region_slots = range(top - self.active_reserve, top)
        self._region = frozenset(range((top - self.active_reserve) * span, top * span))
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
        for b in range(g.reserved_blocks):
            self.kind[b] = Kind.RESERVED
        self._free_out = set(range(g.reserved_blocks, g.num_blocks)) - self._region  # KV may take these
        self._free_in = set(self._region)  # the active region's free blocks
        self._kv_free: dict[int, list[int]] = {}  # KV block -> free page offsets (a stack)
        self._kv_used: dict[int, bytearray] = {}  # KV block -> 1 where the page is allocated
        self._kv_free_total = 0  # free pages in KV blocks
        self._kv_partial: set[int] = set()  # KV blocks with at least one free token
        self._ck_partial: set[int] = set()  # checkpoint blocks with at least one free sub-slot
        self._ck_free: dict[int, set[int]] = {}  # checkpoint block -> free sub-slots
        self._ck_blocks_out = 0  # checkpoint blocks outside the active region
        self._active: set[int] = set()  # active slots (each ``span`` blocks)
        self._ckpt_live = 0

    def free_blocks(self) -> int:
        return len(self._free_out) + len(self._free_in)

    def has_slack(self) -> bool:
        """Whether the budget has a block nobody holds: memory is not short now."""
        return bool(self._free_out or self._free_in)

    def free_block_list(self) -> list[int]:
        return sorted(self._free_out | self._free_in)

    def blocks_of(self, kind: Kind) -> int:
        if kind == Kind.KV:
            return len(self._kv_free)
        if kind == Kind.CKPT:
            return len(self._ck_free)
        if kind == Kind.ACTIVE:
            return len(self._active) * self.span
        if kind == Kind.FREE:
            return self.free_blocks()
        return self.geom.reserved_blocks

    def active_count(self) -> int:
        return len(self._active)

    def _free_slot_runs(self) -> Iterator[int]:
        """Slots allocatable without evicting, in the order :meth:`active_alloc` takes them: the
        region's whole free slots, highest first, then any other aligned run of ``span`` free
        blocks, highest first."""
        for slots in (reversed(self.region_slots), range(self.region_slots.start - 1, 0, -1)):
            yield from (s for s in slots if self._slot_free(s))

    def free_slots(self, limit: Optional[int] = None) -> int:
        """How many active slots are allocatable without evicting (counting stops at ``limit``:
        callers that only compare with a count need not scan the whole buffer)."""
        return sum(1 for _ in islice(self._free_slot_runs(), limit))

    def _slot_blocks(self, slot: int) -> range:
        return range(slot * self.span, (slot + 1) * self.span)

    def _slot_free(self, slot: int) -> bool:
        pool = self._free_in if slot in self.region_slots else self._free_out
        return slot not in self._active and all(b in pool for b in self._slot_blocks(slot))

    def _take_block(self, kind: Kind) -> Optional[int]:
        """KV takes the lowest free block outside the active region; a checkpoint the highest,
        borrowing the region's only when nothing else is free (or KV's floor forbids)."""
        if kind == Kind.KV:
            pool = self._free_out
        else:
            pool = self._free_out if self._ckpt_source_out() else self._free_in
        if not pool:
            return None
        b = min(pool) if kind == Kind.KV else max(pool)
        pool.remove(b)
        self.kind[b] = kind
        c = self.counters
        if kind == Kind.KV:
            c.blocks_to_kv += 1
            c.peak_kv_blocks = max(c.peak_kv_blocks, len(self._kv_free) + 1)
        else:
            c.blocks_to_ckpt += 1
            c.peak_ckpt_blocks = max(c.peak_ckpt_blocks, len(self._ck_free) + 1)
        return b

    def _give_back(self, b: int) -> None:
        self.kind[b] = Kind.FREE
        (self._free_in if b in self._region else self._free_out).add(b)

    # ------------------------------------------------------------------ KV pages
    # The KV side is kept in pages of ``geom.kv_page`` tokens (page ``q`` is tokens
    # ``[q * p, (q + 1) * p)``; at page 1 a page is a token). Free and used are tracked per page.

    def kv_free_tokens(self) -> int:
        return self._kv_free_total * self.geom.kv_page

    def kv_blocks_takeable(self) -> int:
        """Free blocks KV may take now (the active region is not KV's)."""
        return len(self._free_out)

    def kv_available(self) -> int:
        """KV tokens allocatable without evicting anything (whole pages)."""
        return self.kv_free_tokens() + self.kv_blocks_takeable() * self.geom.kv_per_block

    def kv_capacity(self) -> int:
        """KV tokens held + allocatable now: the KV side's current size."""
        return (len(self._kv_free) + self.kv_blocks_takeable()) * self.geom.kv_per_block

    def kv_alloc_pages(self, n: int) -> Optional[list[int]]:
        """``n`` page ids, or None (nothing taken) when fewer pages are available."""
        if n <= 0:
            return []
        if n * self.geom.kv_page > self.kv_available():
            return None
        per = self.geom.pages_per_block
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

    def kv_free_pages(self, pages: Iterable[int]) -> None:
        """Give back these pages, each once; a page that is not allocated raises (nothing after it
        in ``pages`` is freed)."""
        per = self.geom.pages_per_block
        touched = set()
        for q in pages:
            b, off = divmod(int(q), per)
            used = self._kv_used.get(b)
            if used is None or not used[off]:
                raise LedgerError(
                    f"KV page {q} (tokens from {int(q) * self.geom.kv_page}) is not allocated "
                    f"(block {b} is {self.kind[b].name})"
                )
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

    def kv_alloc(self, n: int) -> Optional[list[int]]:
        """``n`` token indices in whole pages (``n`` a multiple of the page), or None (nothing
        taken) when fewer are available."""
        p = self.geom.kv_page
        if n % p:
            raise LedgerError(f"KV is handed out in whole pages of {p} tokens; {n} tokens is not")
        pages = self.kv_alloc_pages(n // p)
        if pages is None or p == 1:
            return pages
        return [q * p + i for q in pages for i in range(p)]

    def kv_free(self, indices: Iterable[int]) -> None:
        """Free the pages these token indices lie in (each page once, as SGLang's paged allocator
        does); at page 1, exactly these tokens."""
        p = self.geom.kv_page
        if p == 1:
            self.kv_free_pages(indices)
        else:
            self.kv_free_pages(sorted({int(t) // p for t in indices}))

    # ------------------------------------------------------------------ active slots
    def active_alloc(self) -> Optional[int]:
        """A state slot whose ``span`` blocks are all free, or None: the region's highest, else
        (its slots held by checkpoints that cannot go now, e.g. the one a hit is restoring from)
        the highest aligned free run elsewhere."""
        s = next(self._free_slot_runs(), None)
        if s is None:
            return None
        pool = self._free_in if s in self.region_slots else self._free_out
        for b in self._slot_blocks(s):
            pool.remove(b)
            self.kind[b] = Kind.ACTIVE
        self._active.add(s)
        c = self.counters
        c.blocks_to_active += self.span
        c.peak_active_blocks = max(c.peak_active_blocks, len(self._active) * self.span)
        return s

    def active_victims(self) -> list[list[int]]:
        """For a state slot when none is whole and free: per region slot with no active state, the
        checkpoint handles that occupy it (the caller ranks them by value). Evicting one list frees that slot."""
        m = self.geom.ckpt_per_block
        out = []
        for s in self.region_slots:
            if s in self._active:
                continue
            handles = [
                b * m + sub
                for b in self._slot_blocks(s)
                if b in self._ck_free
                for sub in range(m)
                if sub not in self._ck_free[b]
            ]
            out.append(handles)
        return out

    def active_free(self, s: int) -> None:
        if s not in self._active:
            raise LedgerError(f"state slot {s} is not an active slot")
        self._active.remove(s)
        for b in self._slot_blocks(s):
            self._give_back(b)

    # ------------------------------------------------------------------ checkpoints
    def ckpt_at_cap(self) -> bool:
        return bool(self.max_checkpoints) and self.ckpt_count() >= self.max_checkpoints

    def _ckpt_source_out(self) -> bool:
        """Whether a checkpoint may take a block outside the active region now (KV's floor)."""
        if not self._free_out:
            return False
        return not self.min_kv_tokens or self.kv_capacity() - self.geom.kv_per_block >= self.min_kv_tokens

    def _ckpt_may_take_block(self) -> bool:
        return self._ckpt_source_out() or bool(self._free_in)

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
            self._ck_blocks_out += b not in self._region
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
            self._ck_blocks_out -= b not in self._region
            self._ck_partial.discard(b)
            self._give_back(b)

    def ckpt_free_count(self) -> int:
        """Checkpoints allocatable now without evicting anything."""
        if self.ckpt_at_cap():
            return 0
        part = sum(len(self._ck_free[b]) for b in self._ck_partial)
        more = self.geom.ckpt_per_block * self.free_blocks() if self._ckpt_may_take_block() else 0
        n = part + more
        return min(n, self.max_checkpoints - self.ckpt_count()) if self.max_checkpoints else n

    def ckpt_count(self) -> int:
        return self._ckpt_live

    def ckpt_blocks_outside_region(self) -> int:
        """Checkpoint blocks KV could have once they empty (counted as blocks come and go: the
        KV allocator's size asks it several times a scheduler step)."""
        return self._ck_blocks_out

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
            "active_bytes": len(self._active) * self.span * g.block_bytes,
            "checkpoint_bytes": len(self._ck_free) * g.block_bytes,
            "checkpoint_used_bytes": self.ckpt_count() * g.ckpt_stride,
            "free_bytes": self.free_blocks() * g.block_bytes,
            "reserved_bytes": g.reserved_blocks * g.block_bytes,
        }

    def block_map(self) -> str:
        """One character a block, for a log line when memory cannot be had: ``R`` reserved, ``K``
        KV, ``A`` active, ``C`` checkpoints, ``.`` free; the active region in brackets."""
        chars = {Kind.FREE: ".", Kind.RESERVED: "R", Kind.KV: "K", Kind.ACTIVE: "A", Kind.CKPT: "C"}
        s = "".join(chars[k] for k in self.kind)
        lo, hi = self.region_slots.start * self.span, self.region_slots.stop * self.span
        return f"{s[:lo]}[{s[lo:hi]}]{s[hi:]}"

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
        active_blocks = [b for s in self._active for b in self._slot_blocks(s)]
        for table, kind in (
            (self._ck_free, Kind.CKPT),
            (active_blocks, Kind.ACTIVE),
            (self._free_out, Kind.FREE),
            (self._free_in, Kind.FREE),
        ):
            for b in table:
                if b in seen:
                    raise LedgerError(f"block {b} is both {seen[b].name} and {kind.name}")
                seen[b] = kind
        if not self._free_in <= self._region or self._free_out & self._region:
            raise LedgerError("the active region's free blocks are misfiled")
        if any(b in self._region for b in self._kv_free) or 0 in self._active:
            raise LedgerError("KV in the active region, or an active state on the padding target")
        if self._ck_blocks_out != sum(1 for b in self._ck_free if b not in self._region):
            raise LedgerError("the count of checkpoint blocks outside the active region is off")
        for b, k in enumerate(self.kind):
            if b < self.geom.reserved_blocks:
                if k != Kind.RESERVED or b in seen:
                    raise LedgerError(f"block {b} must stay reserved (the padding target)")
                continue
            if seen.get(b) != k:
                raise LedgerError(f"block {b}: kind {k.name}, tables say {seen.get(b)}")
        total = 0
        for b, s in self._kv_free.items():
            used = self._kv_used[b]
            if len(s) >= self.geom.pages_per_block or sorted(s) != [i for i, u in enumerate(used) if not u]:
                raise LedgerError(f"KV block {b}: free list and usage map disagree, or it is empty but not free")
            total += len(s)
        if total != self._kv_free_total:
            raise LedgerError("KV free-page count is off")
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
