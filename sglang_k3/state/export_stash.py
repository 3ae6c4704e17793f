"""States exported by the extend forward at chunk boundaries, kept until the cache picks some.

The KDA extend kernel already computes the state at every 64-token chunk boundary of each
sequence (fla's ``chunk_kda(..., return_intermediate_states=True)``; the CPU kernel likewise).
The hooks in ``patches/kda_backend_forward_extend.py`` and ``patches/kda_triton_extend_export.py``
record, per KDA layer, those states ``h`` and the raw pre-conv input of the forward. The conv
state after position ``p`` is the ``K-1`` pre-conv rows before ``p``, so nothing is recomputed:
a checkpoint at a chunk boundary costs one store into a slot, never a second forward.

The stash holds references for one forward only: it is cleared when the next extend forward
begins, and a lookup checks that the sequence's extent matches, so a state is never stored under a
boundary it was not computed for.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

CHUNK = 64  # the KDA kernel's chunk: h[i] is the state after CHUNK * i tokens of the extend


@dataclasses.dataclass
class SeqExport:
    slot: int  # the sequence's active mamba slot (its identity in the batch)
    prefix: int  # tokens before this extend
    length: int  # tokens in this extend
    row_start: int  # first row of the sequence in the batch's token rows
    chunk_offset: int  # first row of the sequence in h's packed chunk axis

    @property
    def end(self) -> int:
        return self.prefix + self.length

    def grid(self) -> list[int]:
        """Absolute positions with an exported state: prefix + 64*i, strictly inside the extend."""
        return [self.prefix + r for r in range(CHUNK, self.length, CHUNK)]


class ExportStash:
    def __init__(self) -> None:
        self.enabled = False
        self._batch_key: Optional[int] = None
        self.seqs: dict[int, SeqExport] = {}
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, batch_key: int, layer_id: int, slots: list[int], prefix_lens: list[int],
              extend_lens: list[int]) -> None:
        """Called at each KDA layer of an extend forward; resets on a new forward (a new batch
        object, or a layer seen again: layers run in order within one forward)."""
        if batch_key == self._batch_key and layer_id not in self.layers:
            return
        self._batch_key = batch_key
        self.layers = {}
        self.seqs = {}
        row = chunk = 0
        for slot, pre, n in zip(slots, prefix_lens, extend_lens):
            if slot >= 0:
                self.seqs[slot] = SeqExport(slot, pre, n, row, chunk)
            row += n
            chunk += -(-n // CHUNK)

    def record_layer(self, layer_id: int, h: torch.Tensor, mixed_qkv: torch.Tensor) -> None:
        self.layers[layer_id] = (h, mixed_qkv)

    def lookup(self, slot: int, end: int) -> Optional[SeqExport]:
        seq = self.seqs.get(slot)
        if seq is None or seq.end != end or not self.layers:
            return None
        return seq

    def store(self, seq: SeqExport, pos: int, dst_slot: int, req_to_token_pool) -> None:
        """Write the state after absolute position ``pos`` (a grid point of ``seq``) into
        ``dst_slot`` for every recorded KDA layer: recurrent from h, conv from the pre-conv rows."""
        r = pos - seq.prefix
        assert 0 < r < seq.length and r % CHUNK == 0, (pos, seq)
        for layer_id, (h, mixed_qkv) in self.layers.items():
            cache = req_to_token_pool.mamba2_layer_cache(layer_id)
            temporal, conv = cache.temporal, cache.conv[0]
            temporal[dst_slot] = h[0, seq.chunk_offset + r // CHUNK].to(temporal.dtype)
            width = conv.shape[-2]  # K - 1 rows of pre-conv input
            rows = mixed_qkv[seq.row_start + r - width : seq.row_start + r]
            conv[dst_slot] = rows.to(conv.dtype)

    def clear(self) -> None:
        self._batch_key = None
        self.seqs = {}
        self.layers = {}


STASH = ExportStash()
