"""Moving tier objects' bytes in and out of SGLang's pools (the :class:`TierIO` of the tier
manager for a running server).

* **MLA KV** is read from and written to the MLA pool's per-layer buffers
  (``MLATokenToKVPool.kv_buffer[layer][index]``, the tensors SGLang's own ``get_cpu_copy`` /
  ``load_cpu_copy`` move), token-major: token t's bytes for every layer are contiguous, so a block
  is cut at any token.
* **A checkpoint** is the checkpoint pool slot's parts in their own dtype
  (:meth:`~sglang_k3.state.checkpoint_pool.CheckpointPool.slot_parts`): INT8 values with their
  fp32 scales and the native conv state, so an INT8 checkpoint stays INT8 all the way down. A
  loaded state is written into a fresh slot and sealed (read-only) like a stored one.

Each call moves its bytes in one copy per direction: on CUDA through a pinned staging buffer the
IO keeps (grown on demand), so a device<->host move runs at the host link's rate rather than a
pageable copy's (``benchmarks/gpu_tier_moves.py``); on CPU a plain memcpy. Calls are synchronous:
the bytes are in host memory (or the device) when they return.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _Staging:
    """Host bytes <-> device tensors. On CUDA through one pinned buffer (reused, grown to the
    largest move so far); elsewhere directly."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.buf: torch.Tensor | None = None

    def _get(self, n: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return self.buf[:n]

    def to_host(self, tensors: Sequence[torch.Tensor]) -> bytes:
        flats = [_flat_bytes(t) for t in tensors]
        total = sum(f.numel() for f in flats)
        if total == 0:
            return b""
        if not self.cuda:
            return b"".join(f.numpy().tobytes() for f in flats)
        stage, off = self._get(total), 0
        for f in flats:
            stage[off : off + f.numel()].copy_(f, non_blocking=True)
            off += f.numel()
        torch.cuda.current_stream(self.device).synchronize()
        return stage.numpy().tobytes()

    def to_device(self, data: bytes) -> torch.Tensor:
        """``data`` as a uint8 tensor on the device (a copy: ``data`` may be reused)."""
        if not self.cuda:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        stage = self._get(len(data))
        stage.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        out = stage.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the staging buffer may be reused next
        return out


def _view(flat: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return flat.view(dtype).reshape(tuple(shape))


class PoolTierIO:
    def __init__(self, kv_buffers: Sequence[torch.Tensor], checkpoint_pool) -> None:
        self.kv = [b for b in kv_buffers if b.shape[0] > 0]
        if not self.kv:
            raise ValueError("no MLA KV buffer to move")
        first = self.kv[0]
        if any(b.dtype != first.dtype or b.shape[1:] != first.shape[1:] for b in self.kv):
            raise ValueError("MLA KV buffers differ in dtype or shape across layers")
        self.kv_dtype = first.dtype
        self.kv_token_shape = tuple(first.shape[1:])
        self.device = first.device
        self._staging = _Staging(first.device)
        self.kv_token_bytes = len(self.kv) * math.prod(self.kv_token_shape) * first.element_size()
        self.pool = checkpoint_pool
        self.state_bytes = int(checkpoint_pool.bytes_per_slot)
        q = checkpoint_pool.q
        self._parts = [
            (t.dtype, tuple(t.shape[1:])) for t in (q, checkpoint_pool.scale, checkpoint_pool.conv) if t is not None
        ]
        self.layout = (
            f"kv={self.kv_dtype}x{len(self.kv)}x{self.kv_token_shape};"
            f"state={';'.join(f'{d}{s}' for d, s in self._parts)}"
        )

    def _index(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(indices), dtype=torch.int64, device=self.device)

    def read_kv(self, indices: Sequence[int]) -> bytes:
        if len(indices) == 0:
            return b""
        idx = self._index(indices)
        return self._staging.to_host([torch.stack([b.index_select(0, idx) for b in self.kv], dim=1)])

    def write_kv(self, indices: Sequence[int], data: bytes) -> None:
        n = len(indices)
        if len(data) != n * self.kv_token_bytes:
            raise ValueError(f"{len(data)} KV bytes for {n} tokens of {self.kv_token_bytes}")
        if n == 0:
            return
        t = _view(self._staging.to_device(data), self.kv_dtype, (n, len(self.kv), *self.kv_token_shape))
        idx = self._index(indices)
        for layer, buf in enumerate(self.kv):
            buf.index_copy_(0, idx, t[:, layer])

    def read_state(self, handle: int) -> bytes:
        return self._staging.to_host(self.pool.slot_parts(handle))

    def write_state(self, handle: int, data: bytes) -> bool:
        if len(data) != self.state_bytes:
            raise ValueError(f"{len(data)} state bytes, a checkpoint here is {self.state_bytes}")
        flat = self._staging.to_device(data)
        parts, off = [], 0
        for dtype, shape in self._parts:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            parts.append(_view(flat[off : off + n], dtype, shape))
            off += n
        return self.pool.load_parts(handle, parts)
