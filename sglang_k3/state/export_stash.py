"""States exported by the extend forward at chunk boundaries: only the rows the cache may store.

The KDA extend kernel already computes the state at every 64-token chunk boundary of each
sequence (fla's ``chunk_kda(..., return_intermediate_states=True)``; the CPU kernel likewise).
The hooks in ``patches/kda_backend_forward_extend.py`` and ``patches/kda_triton_extend_export.py``
hand this stash, per KDA layer, those states ``h`` (``[1, NT, H, V, K]``: one per chunk of the
whole extend) and the layer's raw pre-conv token stream ``mixed_qkv`` (``[T, D]``). The conv state
after position ``p`` is the ``width = K-1`` pre-conv rows before ``p``, so nothing is recomputed:
a checkpoint at a chunk boundary costs one store into a slot, never a second forward.

**Only candidate rows are kept.** The cache stores at most two of a sequence's chunk-boundary
states per forward: the last grid point before the prompt end and the one at or below the
sequence's radix branch point (:meth:`sglang_k3.cache.PlacementPolicy.export_candidates`). So when
a forward begins (:meth:`ExportStash.begin`), the stash asks the cache's *planner*, per request id,
which grid positions it may want, and :meth:`ExportStash.record_layer` copies just those: one
``index_select`` of ``h`` (flattened to ``[B*NT, ...]``) and one of ``mixed_qkv`` (``width`` rows
before each planned boundary). Nothing of the full ``h`` or ``mixed_qkv`` outlives the layer.

Why: keeping references to the full tensors until the next forward pins memory that SGLang's
memory planner never budgeted. At Kimi-Linear-48B dimensions (20 KDA layers, 32 heads, 128 x 128
states, D = 12288) a 64k-token extend exports ``h`` of 1 GiB and ``mixed_qkv`` of 1.5 GiB per layer:
50 GiB for the whole forward. The candidate rows are at most 2 x (1 MiB of bf16 state + 3 x 24 KiB
of conv rows) per sequence per layer: about 43 MiB per sequence for the whole model, independent
of the extend length. :meth:`ExportStash.stash_bytes` reports what is held; ``peak_bytes`` and
``peak_exported_bytes`` (the size of the full tensors a stash of references would have pinned)
are shown in the cache's stats (``/server_info`` -> ``internal_states[i].k3_cache``).

Without a planner or without request ids for the forward (``forward_batch.rids`` is None), the
stash keeps the last grid point of each sequence only (the prompt-end candidate, the common hit).

The stash holds one forward only. Its rows are dropped as soon as every sequence that has kept
rows has been checkpointed (:meth:`ExportStash.consume`: normally in the same scheduler step; a
chunked request's chunk is checkpointed at the start of the next step), and at the latest when the
next extend forward begins (a request aborted in between). That is enough because the cache
stores an extend's states before the next extend starts. Without the overlap scheduler that is
the scheduler's order. With it, a decode step may run between an extend and its results (decode
steps never touch the stash), and ``sglang_k3.launch_server`` sets
``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP=1`` for the k3 backend, so SGLang processes one
extend's results before it launches the next extend. If a user overlaps them anyway, the later
extend's :meth:`begin` drops the earlier one's rows first; those are counted
(``dropped_unconsumed``) and simply not stored. A lookup checks the sequence's extent, and a
position that was not planned is "not available" (``None``): the cache then does not store it. A
state is never stored under a boundary it was not computed for.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterable, NamedTuple, Optional

import torch

from sglang_k3.cache.build import STATE_GRID

CHUNK = STATE_GRID  # the KDA kernel's chunk: h[i] is the state after CHUNK * i tokens of the extend


@dataclasses.dataclass
class SeqExport:
    slot: int  # the sequence's active mamba slot (its identity in the batch)
    prefix: int  # tokens before this extend
    length: int  # tokens in this extend
    row_start: int  # first row of the sequence in the batch's token rows
    chunk_offset: int  # first row of the sequence in h's packed chunk axis
    rid: Optional[str] = None  # the request id, when the forward batch carries them

    @property
    def end(self) -> int:
        return self.prefix + self.length

    def grid(self) -> list[int]:
        """Absolute positions with an exported state: prefix + 64*i, strictly inside the extend."""
        return [self.prefix + r for r in range(CHUNK, self.length, CHUNK)]


# (request id, sequence) -> absolute positions among ``seq.grid()`` whose state may be stored.
Planner = Callable[[str, SeqExport], Iterable[int]]


class LayerRows(NamedTuple):
    """One KDA layer's kept rows; row ``j`` belongs to the ``j``-th planned (slot, pos) pair."""

    h: torch.Tensor  # [n, *h.shape[-3:]]: h's state after each planned boundary, h's dtype
    conv: torch.Tensor  # [n, width, D]: the pre-conv rows before each boundary, oldest first


class ExportStash:
    def __init__(self) -> None:
        self.enabled = False
        self.planner: Optional[Planner] = None
        self.conv_width: Optional[int] = None
        self.num_layers: Optional[int] = None
        self._stack: Optional[LayerRows] = None  # [num_layers, n, ...] buffers of this forward
        self._batch_key: Optional[int] = None
        self.seqs: dict[int, SeqExport] = {}
        # Recorded KDA layers of this forward: model layer id -> kept rows, None if none planned.
        self.layers: dict[int, Optional[LayerRows]] = {}
        self._rows: dict[tuple[int, int], int] = {}  # (slot, pos) -> row j of every layer's rows
        self._unconsumed: set[int] = set()  # slots with kept rows whose request has not checkpointed
        self._chunk_idx: list[int] = []  # row j -> index into h flattened to [B*NT, ...]
        self._token_rows: list[int] = []  # row j -> its `width` rows of mixed_qkv, flattened
        self._dev_idx: Optional[tuple[torch.device, torch.Tensor, torch.Tensor]] = None
        self._held = 0  # bytes of the kept rows
        self._exported = 0  # bytes of the full h and mixed_qkv handed over this forward
        self.peak_bytes = 0
        self.peak_exported_bytes = 0
        self.last_kept_bytes = 0  # what the most recent forward that kept rows kept
        self.generation = 0  # bumped by every clear: identifies one forward's rows
        self.dropped_unconsumed = 0  # sequences whose kept rows the next extend dropped unused (aborted, overlapped)
        self._clear_hooks: list[weakref.WeakMethod] = []

    # ------------------------------------------------------------------ configuration
    def enable(self, planner: Optional[Planner], conv_width: int, num_layers: int) -> None:
        """Turn recording on. ``conv_width`` is the conv state's row count (``K-1``: the mamba
        pool's ``conv.shape[-2]``); ``planner`` picks, per request, the positions to keep;
        ``num_layers`` is the model's KDA layer count: the kept rows of one forward are one
        stacked tensor per kind (``[num_layers, n, ...]``), so that a checkpoint is stored for
        all layers in one launch (:meth:`stacked`)."""
        if not 0 < conv_width <= CHUNK:
            raise ValueError(f"conv width {conv_width} must be in (0, {CHUNK}]")
        if num_layers <= 0:
            raise ValueError(f"num_layers {num_layers} must be positive")
        self.planner = planner
        self.conv_width = int(conv_width)
        self.num_layers = int(num_layers)
        self.enabled = True

    # ------------------------------------------------------------------ recording
    def starts_forward(self, batch_key: int, layer_id: int) -> bool:
        """Whether the KDA layer ``layer_id`` about to run on batch ``batch_key`` begins a new
        extend forward: a new batch object, or a layer seen again (layers run in order within
        one forward). The backend hook calls :meth:`begin` only then."""
        return batch_key != self._batch_key or layer_id in self.layers

    def begin(
        self,
        batch_key: int,
        slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        rids: Optional[list[str]] = None,
    ) -> None:
        """Start a forward: forget the previous one and plan the rows to keep for this one."""
        if self._unconsumed:
            self.dropped_unconsumed += len(self._unconsumed)  # checkpointed too late to use them
        self.clear()
        self._batch_key = batch_key
        if rids is not None and len(rids) != len(slots):
            rids = None  # not one id per sequence (a padded batch): plan without ids
        row = chunk = 0
        for i, (slot, pre, n) in enumerate(zip(slots, prefix_lens, extend_lens)):
            if slot >= 0:
                seq = SeqExport(slot, pre, n, row, chunk, None if rids is None else rids[i])
                self.seqs[slot] = seq
                self._plan(seq)
            row += n
            chunk += -(-n // CHUNK)

    def _plan(self, seq: SeqExport) -> None:
        grid = seq.grid()
        if not grid or self.conv_width is None:
            return
        if self.planner is None or seq.rid is None:
            wanted = {grid[-1]}  # no way to ask: the prompt-end candidate only
        else:
            wanted = set(self.planner(seq.rid, seq)) & set(grid)
        width = self.conv_width
        if wanted:
            self._unconsumed.add(seq.slot)
        for pos in sorted(wanted):
            r = pos - seq.prefix
            self._rows[(seq.slot, pos)] = len(self._chunk_idx)
            self._chunk_idx.append(seq.chunk_offset + r // CHUNK)
            end = seq.row_start + r
            self._token_rows.extend(range(end - width, end))

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._dev_idx is None or self._dev_idx[0] != device:
            ci = torch.tensor(self._chunk_idx, dtype=torch.long, device=device)
            ti = torch.tensor(self._token_rows, dtype=torch.long, device=device)
            self._dev_idx = (device, ci, ti)
        return self._dev_idx[1], self._dev_idx[2]

    def record_layer(self, layer_id: int, h: torch.Tensor, mixed_qkv: torch.Tensor) -> None:
        """Keep this layer's planned rows of ``h`` and ``mixed_qkv`` (copies); drop the rest."""
        self._exported += h.numel() * h.element_size() + mixed_qkv.numel() * mixed_qkv.element_size()
        self.peak_exported_bytes = max(self.peak_exported_bytes, self._exported)
        if not self._chunk_idx:
            self.layers[layer_id] = None  # recorded, nothing planned
            return
        ci, ti = self._indices(h.device)
        n = len(self._chunk_idx)
        hflat = h.reshape((-1,) + tuple(h.shape[-3:]))
        src = mixed_qkv.reshape(-1, mixed_qkv.shape[-1])
        i = len(self.layers)  # this layer's place in the stack: the order layers run in
        if self.num_layers is None or i >= self.num_layers:
            raise RuntimeError(
                f"KDA layer {layer_id} is layer {i + 1} of a forward; the stash was enabled for {self.num_layers}"
            )
        if self._stack is None:
            self._stack = LayerRows(
                torch.empty((self.num_layers, n) + tuple(hflat.shape[1:]), dtype=h.dtype, device=h.device),
                torch.empty((self.num_layers, n, self.conv_width, src.shape[-1]), dtype=src.dtype, device=src.device),
            )
            self._held += sum(t.numel() * t.element_size() for t in self._stack)
        h_rows, conv_rows = self._stack.h[i], self._stack.conv[i]
        torch.index_select(hflat, 0, ci, out=h_rows)
        torch.index_select(src, 0, ti, out=conv_rows.view(n * self.conv_width, src.shape[-1]))
        self.layers[layer_id] = LayerRows(h_rows, conv_rows)
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.last_kept_bytes = self._held

    def stacked(self) -> Optional[LayerRows]:
        """All layers' kept rows as ``[num_layers, n, ...]`` tensors, in the order the layers ran
        (``list(self.layers)``), once every one of the ``num_layers`` layers is recorded; else
        None (no complete state: nothing may be stored from this forward)."""
        if self._stack is None or len(self.layers) != self.num_layers:
            return None
        return self._stack

    # ------------------------------------------------------------------ use
    def lookup(self, slot: int, end: int) -> Optional[SeqExport]:
        seq = self.seqs.get(slot)
        if seq is None or seq.end != end or not self.layers:
            return None
        return seq

    def row(self, seq: SeqExport, pos: int) -> Optional[int]:
        """Row of the state after absolute position ``pos`` of ``seq`` in every recorded layer's
        :class:`LayerRows`; None when it was not kept (not planned, or not this forward's)."""
        if self.seqs.get(seq.slot) is not seq:
            return None
        j = self._rows.get((seq.slot, pos))
        if j is None or self.stacked() is None:
            return None
        return j

    def store(self, seq: SeqExport, pos: int, dst_slot: int, req_to_token_pool) -> bool:
        """Write the state after absolute position ``pos`` of ``seq`` into mamba slot ``dst_slot``
        for every KDA layer (recurrent from ``h``, conv from the pre-conv rows), in the pool's
        dtype: two copies for all layers. False, writing nothing, if that state was not kept."""
        j = self.row(seq, pos)
        if j is None:
            return False
        stack = self._stack
        cache = req_to_token_pool.mamba_pool.mamba_cache
        assert cache.conv[0].shape[-2] == stack.conv.shape[2], (cache.conv[0].shape, stack.conv.shape)
        layers = self.pool_layers(req_to_token_pool.mamba_map)
        cache.temporal[layers, dst_slot] = stack.h[:, j].to(cache.temporal.dtype)
        cache.conv[0][layers, dst_slot] = stack.conv[:, j].to(cache.conv[0].dtype)
        return True

    def pool_layers(self, mamba_map: dict) -> list[int]:
        """The state pool's layer index of each stacked layer (``mamba_map``: model layer id ->
        pool layer index)."""
        return [mamba_map[lid] for lid in self.layers]

    def consume(self, slot: int) -> None:
        """The request in ``slot`` has checkpointed after this forward (it stored what it wanted,
        or nothing). Once every sequence with kept rows has, the rows are dropped at once rather
        than held until the next extend: a chunked request's rows stay until its chunk is
        checkpointed at the start of the next scheduler step."""
        self._unconsumed.discard(slot)
        if not self._unconsumed and self._held:
            self.clear()

    def stash_bytes(self) -> int:
        """Bytes of the rows held now (the full exported tensors are never held)."""
        return self._held

    def on_clear(self, method: Callable[[], None]) -> None:
        """Call the bound ``method`` whenever this forward's rows are dropped (a consumer that made
        something from them, e.g. checkpoints stored ahead, releases what was not claimed). Held
        weakly: a consumer that is gone is forgotten."""
        self._clear_hooks = [r for r in self._clear_hooks if r() is not None]
        if all(r() != method for r in self._clear_hooks):
            self._clear_hooks.append(weakref.WeakMethod(method))

    def clear(self) -> None:
        for ref in list(self._clear_hooks):
            fn = ref()
            if fn is not None:
                fn()
        self.generation += 1
        self._batch_key = None
        self.seqs = {}
        self.layers = {}
        self._rows = {}
        self._unconsumed = set()
        self._chunk_idx = []
        self._token_rows = []
        self._dev_idx = None
        self._stack = None
        self._held = 0
        self._exported = 0


class ExportView:
    """One sequence's exports of the current forward, as the cache's lifecycle sees them
    (:class:`sglang_k3.cache.ports.ExportSource`)."""

    def __init__(self, stash: ExportStash, seq: SeqExport) -> None:
        self.stash, self.seq = stash, seq

    def grid(self) -> list[int]:
        return self.seq.grid()

    def kept(self, pos: int) -> bool:
        return self.stash.row(self.seq, pos) is not None
