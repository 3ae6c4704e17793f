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

Each call moves its bytes once: the device gathers them into one contiguous tensor, then one copy
per host buffer moves them between that tensor and the tier object's payload, with no staging
buffer and no host-side copy. On CUDA the host tier's buffers are page-locked
(:class:`PinnedHostMemory`), so those copies run as DMA; objects that came from Mooncake are
pageable ``bytes`` and copy at the pageable rate. On CPU each is a memcpy. Calls are synchronous:
the bytes are in host memory (or on the device) when they return, so a host buffer may be reused
at once. ``benchmarks/GPU_NOTES.md`` has the rates on an H200.
"""

from __future__ import annotations

import logging
import math
import mmap
import warnings
import weakref
from typing import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _host(buf) -> torch.Tensor:
    """A uint8 tensor over a host buffer, no copy. Stored objects are ``bytes`` (read-only):
    torch warns that writing through such a tensor is undefined; this code only reads them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def _to_host(src: torch.Tensor, outs: Sequence[memoryview]) -> None:
    """``src`` (uint8, any device) into ``outs``, consecutive pieces of it."""
    total = sum(len(o) for o in outs)
    if total != src.numel():
        raise ValueError(f"{src.numel()} bytes to write into {total}")
    off = 0
    for o in outs:
        if len(o):
            _host(o).copy_(src[off : off + len(o)])
            off += len(o)


class PinnedHostMemory:
    """New host-tier buffers on CUDA, page-locked so the device copies into and out of them at
    the host link's rate (``alloc`` of :class:`~sglang_k3.tiers.host_store.HostStore`).

    Each buffer is its own anonymous mapping (page-aligned, so two buffers never share a page,
    which ``cudaHostRegister`` would refuse), registered with ``cudaHostRegister`` and
    unregistered by a finalizer when the buffer is freed (numpy runs weakref callbacks before it
    releases the mapping). Pinning costs a registration per buffer; the host store reuses the
    buffers of the objects it drops, so a full tier pins nothing new. A registration the driver
    refuses leaves a pageable buffer: correct, only slower (counted in ``failures``)."""

    def __init__(self) -> None:
        self._rt = torch.cuda.cudart()
        self.registered = 0
        self.failures = 0

    def __call__(self, n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0, dtype=np.uint8)
        region = mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
        buf = np.frombuffer(region, dtype=np.uint8, count=n)  # holds the mapping while it lives
        ptr = buf.ctypes.data
        rc = self._rt.cudaHostRegister(ptr, n, 0)
        if int(rc) != 0:
            if not self.failures:
                logger.warning("k3 host tier: cudaHostRegister of %d bytes failed (%s); using pageable buffers", n, rc)
            self.failures += 1
            return buf
        self.registered += 1
        weakref.finalize(buf, self._rt.cudaHostUnregister, ptr)
        return buf


def host_buffers_for(device: torch.device):
    """The host tier's ``alloc`` for a server whose pools live on ``device``: pinned on CUDA."""
    return PinnedHostMemory() if device.type == "cuda" else bytearray


def _view(flat: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return flat.view(dtype).reshape(tuple(shape))


def _to_device(parts: Sequence, device: torch.device) -> torch.Tensor:
    """The concatenation of the host buffers ``parts`` as one uint8 tensor on ``device``."""
    sizes = [memoryview(p).nbytes for p in parts]
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    off = 0
    for p, n in zip(parts, sizes):
        if n:
            out[off : off + n].copy_(_host(p))
            off += n
    return out


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

    def read_kv(self, indices: Sequence[int], outs: Sequence[memoryview]) -> None:
        if len(indices) == 0:
            _to_host(torch.empty(0, dtype=torch.uint8), outs)
            return
        idx = self._index(indices)
        _to_host(_flat_bytes(torch.stack([b.index_select(0, idx) for b in self.kv], dim=1)), outs)

    def write_kv(self, indices: Sequence[int], parts: Sequence) -> None:
        n = len(indices)
        data = _to_device(parts, self.device)
        if data.numel() != n * self.kv_token_bytes:
            raise ValueError(f"{data.numel()} KV bytes for {n} tokens of {self.kv_token_bytes}")
        if n == 0:
            return
        t = _view(data, self.kv_dtype, (n, len(self.kv), *self.kv_token_shape))
        idx = self._index(indices)
        for layer, buf in enumerate(self.kv):
            buf.index_copy_(0, idx, t[:, layer])

    def read_state(self, handle: int, out: memoryview) -> None:
        if len(out) != self.state_bytes:
            raise ValueError(f"{len(out)} bytes for a checkpoint of {self.state_bytes}")
        off = 0
        for part in self.pool.slot_parts(handle):
            flat = _flat_bytes(part)
            _to_host(flat, [out[off : off + flat.numel()]])
            off += flat.numel()

    def write_state(self, handle: int, data) -> bool:
        if len(data) != self.state_bytes:
            raise ValueError(f"{len(data)} state bytes, a checkpoint here is {self.state_bytes}")
        flat = _to_device([data], self.device)
        parts, off = [], 0
        for dtype, shape in self._parts:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            parts.append(_view(flat[off : off + n], dtype, shape))
            off += n
        return self.pool.load_parts(handle, parts)
