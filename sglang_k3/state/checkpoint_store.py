"""Where the k3 tree's checkpoints live, by checkpoint dtype.

* ``fp32`` (:class:`NativeSlotStore`): a checkpoint is a slot of SGLang's mamba pool, in the
  active state's own format. A finished request's slot is *donated* (no copy); a hit is a
  deferred copy SGLang runs on the forward stream (``mamba_cow_src_index``). Bit-exact.
* ``int8`` / ``bf16`` (:class:`QuantizedStore`): a checkpoint is a slot of a separate
  :class:`~sglang_k3.state.checkpoint_pool.CheckpointPool` (INT8 with per-(layer, head, k) fp32
  scales, or bf16; conv state in its native dtype). Storing quantizes; a hit is dequantized into
  the request's fresh fp32 active slot at the first KDA layer of its next extend, together with
  the other hits of that forward, in one launch (``deferred_restore.py``; SGLang's own deferred
  copy only knows same-pool copies). A restored state continues in full precision and is never
  requantized.

Both give the cache the same verbs: ``capture_active`` (fork the running request's state at a
boundary), ``donate`` (a finished request's state), ``capture_export`` (a chunk-boundary state
the extend exported), ``restore`` (copy-on-write into a request), ``free``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang_k3.state.active_slots import SlotPool
from sglang_k3.state.checkpoint_pool import CheckpointPool
from sglang_k3.state.deferred_restore import RESTORES
from sglang_k3.state.export_stash import STASH, SeqExport

CHECKPOINT_DTYPES = ("int8", "bf16", "fp32")


class NativeSlotStore:
    uses_mamba_slots = True
    dtype = "fp32"

    def __init__(self, slots: SlotPool):
        self.slots = slots
        self.slot_bytes = slots.slot_bytes

    def alloc(self) -> Optional[int]:
        return self.slots.alloc()

    def free(self, handles: list[int]) -> None:
        self.slots.free(handles)

    def capture_active(self, active_slot: int) -> Optional[int]:
        dst = self.slots.alloc()
        if dst is not None:
            self.slots.copy(active_slot, dst)
        return dst

    def donate(self, active_slot: int) -> Optional[int]:
        """The handle now owning ``active_slot``'s state: the slot itself (the caller must stop
        using it)."""
        return active_slot

    def capture_export(self, seq: SeqExport, pos: int) -> Optional[int]:
        if len(STASH.layers) != len(self.slots.rtp.mamba_map) or STASH.row(seq, pos) is None:
            return None  # not every KDA layer recorded this forward, or that state was not kept
        dst = self.slots.alloc()
        if dst is not None and not STASH.store(seq, pos, dst, self.slots.rtp):
            self.slots.free([dst])  # defensive (row() said it was kept): never keep a blank slot
            return None
        return dst

    def restore(self, handle: int, req) -> None:
        """Deferred copy-on-write: SGLang copies ``handle`` into the request's slot before the
        KDA layers of its next forward."""
        req.kv.mamba_cow_src_index = self.slots.index_tensor(handle)
        req.kv.mamba_needs_clear = False


class QuantizedStore:
    uses_mamba_slots = False

    def __init__(self, slots: SlotPool, dtype: str, num_slots: int, evict_bytes: Callable[[int], int]):
        self.slots = slots
        self.dtype = dtype
        self.pool = CheckpointPool.from_mamba_pool(slots.pool, num_slots=num_slots, dtype=dtype)
        # a hit is dequantized by RESTORES.flush() at the next extend forward, batched with the
        # other hits of that forward (the cache keeps the pin until after it)
        RESTORES.bind(self.pool)
        # exported states stored ahead for the current forward: stash row -> checkpoint slot
        self._ahead: dict[int, int] = {}
        self._ahead_generation = -1
        self.ahead_stored = 0  # slots stored ahead, lifetime
        self.ahead_unclaimed = 0  # of those, released unclaimed
        STASH.on_clear(self._release_ahead)
        self.slot_bytes = self.pool.bytes_per_slot
        self._evict_bytes = evict_bytes
        # model layer id -> pool layer index (the order of the mamba pool's layer axis)
        self._pool_layer = dict(slots.rtp.mamba_map)

    def alloc(self) -> Optional[int]:
        got = self.pool.alloc(1)
        if got is None:
            self._evict_bytes(self.slot_bytes)
            got = self.pool.alloc(1)
        return None if got is None else got[0]

    def free(self, handles: list[int]) -> None:
        if handles:
            self.pool.decref(handles)

    def capture_active(self, active_slot: int) -> Optional[int]:
        dst = self.alloc()
        if dst is None:
            return None
        res = self.pool.store([active_slot], [dst])
        return dst if res.all_ok else None  # a non-finite state is refused (slot released)

    donate = capture_active  # a quantized checkpoint cannot take over an fp32 slot: store it

    def capture_export(self, seq: SeqExport, pos: int) -> Optional[int]:
        if len(STASH.layers) != self.pool.L:
            return None  # not every KDA layer recorded this forward: no complete state
        j = STASH.row(seq, pos)
        if j is None:
            return None  # the forward did not keep that state
        stack = STASH.stacked()
        if stack is not None and [self._pool_layer[lid] for lid in STASH.layers] == list(range(self.pool.L)):
            # Every kept row of this forward is stored at the first request's call, all rows and
            # all layers in one launch (one refusal-flag sync); each request then claims its own.
            if self._ahead_generation != STASH.generation:
                self._store_forward_ahead(stack)
            return self._ahead.pop(j, None)
        dst = self.alloc()
        if dst is None:
            return None
        for layer_id, rows in STASH.layers.items():
            # The stash's compact rows: state j is h row j; its conv window is conv row j, i.e.
            # the `width` rows of the flattened [n*width, D] stream ending at (j+1)*width.
            width = rows.conv.shape[1]
            res = self.pool.store_from_intermediate(
                self._pool_layer[layer_id], rows.h, [j], [dst], state_v_first=True,
                conv_src=rows.conv.reshape(-1, rows.conv.shape[-1]), token_ends=[(j + 1) * width],
            )
            if not res.all_ok:
                return None  # refused and released by the pool
        return dst

    def _store_forward_ahead(self, stack) -> None:
        """Store all of this forward's kept rows into fresh checkpoint slots, in one call. A row
        that gets no slot (the pool is full of pinned checkpoints) or is refused (non-finite) is
        simply not available, as a failed single store would be."""
        self._release_ahead()
        self._ahead_generation = STASH.generation
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
        res = self.pool.store_from_intermediate(
            range(self.pool.L), stack.h, rows, slots, state_v_first=True,
            conv_src=stack.conv.reshape(self.pool.L, n * width, d), token_ends=[(r + 1) * width for r in rows],
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

    def restore(self, handle: int, req) -> None:
        """Deferred copy-on-write into the request's fresh fp32 slot: at the first KDA layer of its
        next extend, batched with the forward's other hits (``deferred_restore.py``)."""
        RESTORES.add(req.rid, handle, int(req.kv.mamba_pool_idx))
        req.kv.mamba_cow_src_index = None  # not upstream's COW: its copy knows only the mamba pool
        req.kv.mamba_needs_clear = False


def make_store(dtype: str, slots: SlotPool, num_slots: int, evict_bytes: Callable[[int], int]):
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint dtype {dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}")
    if dtype == "fp32":
        if slots.pool.mamba_cache.temporal.dtype != torch.float32:
            raise ValueError("--k3-checkpoint-dtype fp32 keeps checkpoints in the mamba pool, "
                             "whose recurrent state is not fp32 here")
        return NativeSlotStore(slots)
    return QuantizedStore(slots, dtype, num_slots, evict_bytes)
