"""The Triton kernel of ``k3sum64`` (CUDA path); equal to :mod:`.reference` bit for bit.

One launch covers every piece: the pieces are cut into chunks of ``CHUNK`` words, and program
``c`` sums the mixed words of chunk ``c`` (its piece's byte offset, the index of its first word in
the piece, the piece's bytes from there). The host then adds each piece's chunk sums and folds in
its length. Words are assembled from four byte loads, so a piece may start at any byte (the
boundary object's state is followed by KV with no padding); the four loads of a warp hit the same
cache lines and the pass stays bound by memory bandwidth.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .reference import C1, C2, MASK, finish

CHUNK = 16384  # words per program (64 KiB)
BLOCK = 1024


@triton.jit
def _k3sum_chunks(src_ptr, table_ptr, out_ptr, n_chunks, CHUNK_W: tl.constexpr, BLOCK_W: tl.constexpr):
    c = tl.program_id(0)
    off = tl.load(table_ptr + c)  # byte offset of the chunk's first word in src
    j0 = tl.load(table_ptr + n_chunks + c)  # that word's index in its piece
    rem = tl.load(table_ptr + 2 * n_chunks + c)  # the piece's bytes from that word on
    acc = tl.zeros([BLOCK_W], dtype=tl.uint64)
    for t in range(0, CHUNK_W, BLOCK_W):
        jj = (t + tl.arange(0, BLOCK_W)).to(tl.int64)
        b = jj * 4
        p = src_ptr + off + b
        w = tl.load(p, mask=b < rem, other=0).to(tl.uint64)
        w |= tl.load(p + 1, mask=b + 1 < rem, other=0).to(tl.uint64) << 8
        w |= tl.load(p + 2, mask=b + 2 < rem, other=0).to(tl.uint64) << 16
        w |= tl.load(p + 3, mask=b + 3 < rem, other=0).to(tl.uint64) << 24
        x = w | ((j0 + jj).to(tl.uint64) << 32)
        x ^= x >> 33
        x *= 0xFF51AFD7ED558CCD
        x ^= x >> 33
        x *= 0xC4CEB9FE1A85EC53
        x ^= x >> 33
        acc += tl.where(b < rem, x, 0)
    tl.store(out_ptr + c, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


assert (C1, C2) == (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)  # the constants written in the kernel


def chunk_table(offsets: Sequence[int], sizes: Sequence[int], chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's table for the pieces ``(offset, size)``: for each chunk of ``chunk`` words,
    its byte offset, the index of its first word in its piece and the piece's bytes from there
    (three int64 rows, concatenated); and the index of each piece's first chunk (every piece has
    one, an empty piece an empty one), for adding the chunk sums per piece."""
    offs = np.asarray(offsets, dtype=np.int64)
    nbytes = np.asarray(sizes, dtype=np.int64)
    per = np.maximum(((nbytes + 3) // 4 + chunk - 1) // chunk, 1)
    starts = np.cumsum(per) - per
    piece = np.repeat(np.arange(offs.size), per)
    j0 = (np.arange(piece.size) - np.repeat(starts, per)) * chunk
    return np.concatenate([offs[piece] + 4 * j0, j0, nbytes[piece] - 4 * j0]), starts


def k3sum64_pieces(src: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], after=None):
    """Launch the checksums of ``src[off : off + n]`` (``src`` 1-D uint8 on CUDA) on the current
    stream, after the event ``after`` if given (the table of chunks goes up before that wait, so
    it does not queue behind what ``after`` waits for). Returns a callable giving them: it waits
    for the kernel and copies its per-chunk sums down (a few KB), then adds them per piece. No
    page-locked memory is taken for the result: with copies queued, every fresh page-locked block
    is a ``cudaHostAlloc``."""
    if src.dtype != torch.uint8 or src.dim() != 1:
        raise ValueError("k3sum64 runs over a 1-D uint8 tensor")
    nbytes = np.asarray(sizes, dtype=np.int64)
    if len(offsets) and (min(offsets) < 0 or (np.asarray(offsets) + nbytes).max() > src.numel()):
        raise ValueError("a piece lies outside the tensor")
    table, starts = chunk_table(offsets, sizes)
    n_chunks = table.size // 3
    out = torch.empty(n_chunks, dtype=torch.int64, device=src.device)  # every program writes its own
    stream = torch.cuda.current_stream()
    if n_chunks:
        tab = torch.from_numpy(table).pin_memory().to(src.device, non_blocking=True)
        if after is not None:
            stream.wait_event(after)
        _k3sum_chunks[(n_chunks,)](src, tab, out, n_chunks, CHUNK_W=CHUNK, BLOCK_W=BLOCK)
    done = torch.cuda.Event()
    done.record(stream)

    def result() -> list[int]:
        done.synchronize()
        partial = out.cpu().numpy().view(np.uint64)
        sums = np.add.reduceat(partial, starts) if n_chunks else np.zeros(0, dtype=np.uint64)
        return [finish(int(s) & MASK, int(n)) for s, n in zip(sums, nbytes)]

    return result
