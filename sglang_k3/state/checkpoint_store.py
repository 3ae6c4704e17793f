"""Where the k3 tree's checkpoints live on the device, by checkpoint dtype: two implementations of
the lifecycle's :class:`~sglang_k3.cache.ports.CheckpointStore` interface.

* ``fp32`` (:class:`NativeSlotStore`): a checkpoint is a slot of SGLang's mamba pool, in the
  active state's own format. A finished request's slot is *donated* (no copy); a hit is a
  deferred copy SGLang runs on the forward stream (``mamba_cow_src_index``). Bit-exact.
* ``int8`` / ``bf16`` (:class:`QuantizedStore`): a checkpoint is a slot of a separate
  :class:`~sglang_k3.state.checkpoint_pool.CheckpointPool` (INT8 with per-(layer, head, k) fp32
  scales, or bf16; conv state in its native dtype). Storing quantizes; a hit is dequantized into
  the request's fresh fp32 active slot at the first KDA layer of its next extend, together with
  the other hits of that forward, in one launch (:mod:`sglang_k3.state.deferred_restore`;
  SGLang's own deferred copy only knows same-pool copies). A restored state continues in full
  precision and is never requantized.

Under unified memory (the default) every dtype uses :class:`QuantizedStore` (fp32 as a bit-exact
copy), its pool a set of views into the unified buffer whose handles the budget's ledger hands
out (:class:`UnifiedCheckpointMemory`); :class:`NativeSlotStore` serves ``--k3-no-unified-memory`` with
fp32 checkpoints, unless a lower tier is on: a tier reads and writes checkpoints as slots of a
checkpoint pool, so fp32 ones then go to a pool of ``--k3-checkpoint-slots`` fp32 slots of their
own (a bit-exact copy, not a donated slot).

Neither touches SGLang's request objects: ``restore`` returns what SGLang's own copy mechanism
should read, and the cache writes the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sglang_k3.config import CHECKPOINT_DTYPES
from sglang_k3.state.active_slots import SlotPool
from sglang_k3.state.checkpoint_pool import CheckpointPool
from sglang_k3.state.export_stash import ExportView
from sglang_k3.state.forward_state import ForwardState


class NativeSlotStore:
    """fp32 checkpoints as slots of SGLang's mamba pool."""

    dtype = "fp32"
    shares_active_slots = True
    batches_stores = False

    def __init__(self, slots: SlotPool, fwd: ForwardState):
        self.slots = slots
        self.fwd = fwd
        self.slot_bytes = slots.slot_bytes

    def alloc(self) -> Optional[int]:
        return self.slots.alloc()

    def free(self, handles: Sequence[int]) -> None:
        self.slots.free(list(handles))

    def release_active(self, active_slot: int) -> None:
        self.slots.free([active_slot])

    def capture_active(self, active_slot: int) -> Optional[int]:
        dst = self.slots.alloc()
        if dst is not None:
            self.slots.copy(active_slot, dst)
        return dst

    def donate(self, active_slot: int) -> Optional[int]:
        """The slot itself now holds the checkpoint (the caller stops using it as active)."""
        return active_slot

    def capture_export(self, source: ExportView, pos: int) -> Optional[int]:
        dst = self.slots.alloc()
        if dst is not None and not source.stash.store(source.seq, pos, dst, self.slots.rtp):
            self.slots.free([dst])  # not kept after all: never keep a blank slot
            return None
        return dst

    def store_many(self, active_slots: Sequence[int], handles: Sequence[int]) -> list[bool]:
        for a, h in zip(active_slots, handles):
            self.slots.copy(a, h)
        return [True] * len(handles)

    def restore(self, handle: int, rid: str, active_slot: int) -> Optional[int]:
        """SGLang copies ``handle`` into the request's slot before the KDA layers of its next
        forward (``mamba_cow_src_index``)."""
        return handle

    def cancel_restore(self, rid: str) -> None:
        """SGLang's own copy is dropped with the request; nothing is pending here."""

    def stats(self) -> dict[str, int]:
        return {"export_ahead_stored": 0, "export_ahead_unclaimed": 0}  # exports are stored one by one


class QuantizedStore:
    """int8/bf16 checkpoints in a checkpoint pool of their own."""

    shares_active_slots = False
    batches_stores = True

    def __init__(
        self,
        slots: SlotPool,
        dtype: str,
        num_slots: int,
        evict_bytes: Callable[[int], object],
        fwd: ForwardState,
        unified: Optional["UnifiedCheckpointMemory"] = None,
    ):
        self.slots = slots
        self.dtype = dtype
        self.fwd = fwd
        if unified is None:
            self.pool = CheckpointPool.from_mamba_pool(slots.pool, num_slots=num_slots, dtype=dtype)
        else:  # checkpoints in the unified budget: its views, its ledger decides the handles
            self.pool = CheckpointPool.from_mamba_pool(
                slots.pool,
                num_slots=unified.buffers[0].shape[0],
                dtype=dtype,
                buffers=unified.buffers,
                slots=unified.ledger_slots,
            )
        # a hit is dequantized by fwd.restores.flush() at the next extend forward, batched with the
        # other hits of that forward (the cache keeps the pin until after it)
        fwd.restores.bind(self.pool)
        # exported states stored ahead for the current forward: stash row -> checkpoint slot
        self._ahead: dict[int, int] = {}
        self._ahead_generation = -1
        self.ahead_stored = 0  # slots stored ahead, lifetime
        self.ahead_unclaimed = 0  # of those, released unclaimed
        fwd.stash.on_clear(self._release_ahead)
        self.slot_bytes = self.pool.bytes_per_slot
        self._evict_bytes = evict_bytes
        self._mamba_map = dict(slots.rtp.mamba_map)  # model layer id -> pool layer index

    def alloc(self) -> Optional[int]:
        got = self.pool.alloc(1)
        if got is None:
            self._evict_bytes(self.slot_bytes)
            got = self.pool.alloc(1)
        return None if got is None else got[0]

    def free(self, handles: Sequence[int]) -> None:
        if handles:
            self.pool.decref(list(handles))

    def release_active(self, active_slot: int) -> None:
        self.slots.free([active_slot])

    def store_many(self, active_slots: Sequence[int], handles: Sequence[int]) -> list[bool]:
        """Quantize in one launch; a non-finite state is refused (its slot released)."""
        return list(self.pool.store(list(active_slots), list(handles)).accepted)

    def capture_active(self, active_slot: int) -> Optional[int]:
        dst = self.alloc()
        if dst is None:
            return None
        return dst if self.store_many([active_slot], [dst])[0] else None

    # a quantized checkpoint cannot take over an fp32 slot: store it (the cache then releases it)
    donate = capture_active

    def capture_export(self, source: ExportView, pos: int) -> Optional[int]:
        """Every kept row of this forward is stored at the first request's call, all rows and all
        layers in one launch (one refusal-flag sync); each request then claims its own."""
        stash = source.stash
        j = stash.row(source.seq, pos)
        stack = stash.stacked()
        if j is None or stack is None:
            return None
        if self._ahead_generation != stash.generation:
            self._store_forward_ahead(stash, stack)
        return self._ahead.pop(j, None)

    def _store_forward_ahead(self, stash, stack) -> None:
        """Store all of this forward's kept rows into fresh checkpoint slots, in one call. A row
        that gets no slot (the pool is full of pinned checkpoints) or is refused (non-finite) is
        simply not available, as a failed single store would be."""
        self._release_ahead()
        self._ahead_generation = stash.generation
        n, width, d = stack.conv.shape[1:]
        rows, slots = [], []
        for r in range(n):
            dst = self.alloc()
            if dst is None:
                break
            rows.append(r)
            slots.append(dst)
        if not slots:
            return
        layers = stash.pool_layers(self._mamba_map)
        if layers != list(range(self.pool.L)):
            raise RuntimeError(f"KDA layers ran in pool order {layers}, expected 0..{self.pool.L - 1}")
        res = self.pool.store_from_intermediate(
            range(self.pool.L),
            stack.h,
            rows,
            slots,
            state_v_first=True,
            conv_src=stack.conv.reshape(self.pool.L, n * width, d),
            token_ends=[(r + 1) * width for r in rows],
        )
        self._ahead = {r: s for r, s, ok in zip(rows, slots, res.accepted) if ok}
        self.ahead_stored += len(self._ahead)

    def _release_ahead(self) -> None:
        """Free the slots stored ahead that no request claimed (the cache already had a checkpoint
        there, or the request went away). Runs when the stash drops the forward's rows."""
        if self._ahead:
            self.ahead_unclaimed += len(self._ahead)
            self.pool.decref(list(self._ahead.values()))
        self._ahead = {}

    def restore(self, handle: int, rid: str, active_slot: int) -> Optional[int]:
        """Deferred: at the first KDA layer of the request's next extend, batched with the
        forward's other hits. SGLang's own copy is not used (it knows only the mamba pool)."""
        self.fwd.restores.add(rid, handle, active_slot)
        return None

    def cancel_restore(self, rid: str) -> None:
        self.fwd.restores.drop(rid)

    def stats(self) -> dict[str, int]:
        return {"export_ahead_stored": self.ahead_stored, "export_ahead_unclaimed": self.ahead_unclaimed}


class LedgerSlots:
    """The unified budget's ledger as a checkpoint pool's slot source."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def alloc(self) -> Optional[int]:
        return self.ledger.ckpt_alloc()

    def free(self, handle: int) -> None:
        self.ledger.ckpt_free(handle)

    def available(self) -> int:
        return self.ledger.ckpt_free_count()


@dataclass(frozen=True)
class UnifiedCheckpointMemory:
    """The unified buffer's part for checkpoints: its views (where the bytes are) and the ledger's
    checkpoint slots (which are free). Not a placement policy: where checkpoints are *placed* in
    the tree is ``sglang_k3.cache.placement``."""

    buffers: tuple  # q, scale, conv (see UnifiedBuffer.checkpoint_views)
    ledger_slots: LedgerSlots


def make_store(
    dtype: str,
    slots: SlotPool,
    num_slots: int,
    evict_bytes: Callable[[int], object],
    fwd: ForwardState,
    unified: Optional[UnifiedCheckpointMemory] = None,
    pooled: bool = False,
):
    """The checkpoint store for ``dtype``. With ``unified`` every dtype (fp32 included: a bit-exact
    copy, not a donated slot) goes to the quantized store in the unified budget. ``pooled``: the
    checkpoints must be slots of a checkpoint pool (a lower tier moves them), so fp32 ones go to a
    pool of ``num_slots`` fp32 slots instead of the mamba pool."""
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint dtype {dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}")
    if unified is not None:
        return QuantizedStore(slots, dtype, 0, evict_bytes, fwd, unified)
    if dtype == "fp32" and not pooled:
        if slots.pool.mamba_cache.temporal.dtype != torch.float32:
            raise ValueError(
                "--k3-checkpoint-dtype fp32 keeps checkpoints in the mamba pool, whose recurrent state is not fp32 here"
            )
        return NativeSlotStore(slots, fwd)
    return QuantizedStore(slots, dtype, num_slots, evict_bytes, fwd)
