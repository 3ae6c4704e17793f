"""Quantized checkpoint hits, restored in one batch at the forward that reads them.

A hit on an INT8 (or bf16) checkpoint must be dequantized into the request's fresh fp32 slot before
the KDA layers of its next extend read that slot. Done at match time, each hit costs its own
launch and its own host sync, on the scheduler's stream rather than the forward's. SGLang runs its
own copy-on-write for a batch once, on the forward stream, before the mamba layers (its
``_maybe_execute_deferred_mamba_cow_and_clear``). We do the same for our pool: the cache records
``(checkpoint slot, active slot)`` per request here at match time, and the first KDA layer of the
next extend forward (``patches/kda_backend_forward_extend.py``) calls :meth:`flush`, which restores
every pending hit in one ``gather_dequant`` launch, before that layer reads the pool.

One per cache (it owns it: :mod:`sglang_k3.state.forward_state`). The checkpoint slot stays
pinned in the tree until the request's next ``checkpoint`` (the cache's rule for deferred
copies), so it cannot be evicted or reused before the flush. A request
that is matched again, refused by SGLang's prefill adder, released or aborted before its
forward drops its entry (:meth:`drop`).
A pending entry is keyed by request id, and an active slot is owned by one live request, so a
flush never writes a slot another request owns.
"""

from __future__ import annotations

from typing import Optional


class DeferredRestores:
    def __init__(self) -> None:
        self.pool = None  # the CheckpointPool the entries refer to (the cache binds it)
        self._pending: dict[str, tuple[int, int]] = {}  # rid -> (checkpoint slot, active slot)
        self.flushes = 0  # flush calls that restored something
        self.restored = 0  # restores done by them

    def bind(self, pool) -> None:
        self.pool = pool
        self.clear()

    def add(self, rid: str, ckpt_slot: int, active_slot: int) -> None:
        if self.pool is None:
            raise RuntimeError("deferred restores: no checkpoint pool bound")
        self._pending[rid] = (int(ckpt_slot), int(active_slot))

    def drop(self, rid: str) -> Optional[tuple[int, int]]:
        return self._pending.pop(rid, None)

    def clear(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Restore every pending hit, in one launch; returns how many."""
        if not self._pending:
            return 0
        ckpt, active = zip(*self._pending.values())
        self._pending.clear()
        self.pool.restore(list(ckpt), list(active))
        self.flushes += 1
        self.restored += len(ckpt)
        return len(ckpt)
