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

**A save** (:meth:`PoolTierIO.read_payloads`) gathers everything it writes (the KV blocks, the
state, the tail KV) into one contiguous tensor on the device, launches the checksums of all its
objects over that tensor (:mod:`sglang_k3.kernels.tier`, one kernel) and enqueues one copy per
object into the objects' payloads; it returns at once, with a
:data:`~sglang_k3.tiers.ports.PendingRead` that the tier writer's thread waits on (so the
scheduler's thread never waits for the link). The copies are stream-ordered after the gather, so
the device memory may be freed and reused as soon as the call returns. **A load** (:meth:`PoolTierIO.load_payloads`)
copies the objects' payloads up into one tensor, checks every checksum on the device, and only
then writes the KV and the state into the pools, one wait for all of it.

On CUDA the host tier's buffers are page-locked (:class:`PinnedHostMemory`), so the copies are
asynchronous DMA; objects that came from Mooncake are pageable ``bytes`` and copy at the pageable
rate. On CPU each copy is a memcpy and the checksums run on the host (the numpy reference), when
the callable is called. ``benchmarks/GPU_NOTES.md`` has the rates on an H100 and an H200.
"""

from __future__ import annotations

import atexit
import logging
import math
import mmap
import queue
import threading
import warnings
import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_k3.kernels.tier import device_checksums

logger = logging.getLogger(__name__)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# Stored objects are ``bytes`` (read-only): torch warns that writing through a tensor over one is
# undefined; this module only reads them. Filtered once here: a ``catch_warnings`` around each
# ``frombuffer`` cost more than the call itself (2 us, a few hundred times per boundary).
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def _host(buf) -> torch.Tensor:
    """A uint8 tensor over a host buffer, no copy."""
    return torch.frombuffer(buf, dtype=torch.uint8)


def _copy_pieces(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i] <- src[i]``, between the host and the device, asynchronous where the host side
    is page-locked: one call for every piece (torch loops in C++; a Python loop of ``copy_`` cost
    about as much per 516 KB KV block as the link itself)."""
    pairs = [(d, s) for d, s in zip(dst, src) if s.numel()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=True)


def _nbytes(p) -> int:
    return p.numel() if isinstance(p, torch.Tensor) else memoryview(p).nbytes


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, off = [], 0
    for n in sizes:
        out.append(off)
        off += n
    return out


class _PinThread:
    """One daemon thread that runs the pinning calls in order (:class:`PinnedHostMemory`).

    Jobs are handed over through a :class:`queue.SimpleQueue`, whose ``put`` is reentrant: a
    buffer's finalizer posts its unregistration, and a finalizer can run inside any allocation
    (the cyclic garbage collector runs there), including one made while a job is being handed
    over. A ``ThreadPoolExecutor`` took its own lock in ``submit`` and allocated under it, so a
    collection there whose finalizer submitted again deadlocked the thread: seen on an H100, the
    saving thread stopped for good inside ``submit`` (``benchmarks/GPU_NOTES.md``, fifteenth
    session).

    **At interpreter exit** the thread runs what it was handed, then ends (:meth:`stop`, an
    ``atexit`` hook), and later calls run on the caller. Buffers still alive at exit are
    unregistered by their finalizers, which ``weakref.finalize`` runs from an ``atexit`` hook of
    its own: before this one, they post here and are run before the thread ends; after it, they
    run on the main thread. Before this hook, a daemon thread still inside such a call while the
    interpreter finalized was ended mid-call: on an H100 both host-tier benchmark runs at 9fa71de
    aborted at exit (``terminate called without an active exception``, status 134)."""

    STOP_TIMEOUT_S = 30.0  # at exit, how long to wait for the unregistrations already handed over

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="k3-host-pin", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            self._do(*job)
        while True:  # handed over while the stop was being posted
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._do(*job)

    @staticmethod
    def _do(fn, args, reply) -> None:
        try:
            out = fn(*args)
        except BaseException as e:  # handed back to the caller
            out = e
        if reply is not None:
            reply[0].append(out)
            reply[1].set()

    def stop(self) -> None:
        """Run what was handed over, then end the thread; later calls run on the caller."""
        if self._closing:
            return
        self._closing = True
        self._q.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.STOP_TIMEOUT_S)

    def _live(self) -> bool:
        return not self._closing and self._thread.is_alive()

    def call(self, fn, *args):
        """``fn(*args)`` on the pin thread; its result (or its exception, raised here)."""
        if not self._live():
            return fn(*args)
        reply: tuple = ([], threading.Event())
        self._q.put((fn, args, reply))
        while not reply[1].wait(1.0):
            if not self._thread.is_alive():  # ended at exit before it came to this call
                return fn(*args)
        out = reply[0][0]
        if isinstance(out, BaseException):
            raise out
        return out

    def post(self, fn) -> None:
        """Run ``fn()`` on the pin thread, not waited for; safe inside a finalizer."""
        if self._live():
            self._q.put((fn, (), None))
        else:
            fn()


# cudaErrorHostMemoryAlreadyRegistered: part of the range is page-locked already
HOST_MEMORY_ALREADY_REGISTERED = 712


class PinnedHostMemory:
    """New host-tier buffers on CUDA, page-locked so the device copies into and out of them at
    the host link's rate (``alloc`` of :class:`~sglang_k3.tiers.host_store.HostStore`).

    Each buffer is its own anonymous mapping (page-aligned, so two buffers never share a page),
    registered with ``cudaHostRegister`` and unregistered when the buffer is freed. Pinning costs
    a registration per buffer; the host store reuses the buffers of the objects it drops, so a
    full tier pins nothing new. A registration the driver refuses leaves a pageable buffer:
    correct, only slower (counted in ``failures``).

    **Every registration and unregistration runs on one thread of its own**, which launches
    nothing. A refused call leaves its error as the calling thread's last CUDA error, and torch's
    runtime binding has no ``cudaGetLastError`` to clear it: on the scheduler's thread the next
    kernel launch raised it (seen on an H200: a refused registration failed the save of 18
    boundaries at its ``index_select``; in a forward it would stop the server). On this thread the
    error stays where nothing reads it.

    **A range the driver already holds registered** (``cudaErrorHostMemoryAlreadyRegistered``,
    seen on the GPU with fresh mappings; the cause is not known) is never used: a copy through it
    would use the driver's old registration of that address. Its mapping is kept (``held``), so
    the address is not handed out again, and a new mapping is tried (``stale_ranges``). For the
    same reason a mapping whose unregistration the driver refuses is kept mapped
    (``unregister_failures``). ``runtime``: the CUDA runtime's ``cudaHostRegister`` /
    ``cudaHostUnregister`` (torch's, by default)."""

    ATTEMPTS = 3  # mappings tried for one buffer while the driver reports their range registered

    def __init__(self, runtime=None) -> None:
        self._rt = runtime if runtime is not None else torch.cuda.cudart()
        self._pin = _PinThread()
        self.registered = 0
        self.failures = 0
        self.stale_ranges = 0
        self.unregister_failures = 0
        self.held: list[mmap.mmap] = []  # mappings never unmapped: the driver may hold their range

    def _call(self, fn, *args) -> int:
        return int(self._pin.call(fn, *args))

    def __call__(self, n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0, dtype=np.uint8)
        size = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        for _ in range(self.ATTEMPTS):
            region = mmap.mmap(-1, size)
            buf = np.frombuffer(region, dtype=np.uint8, count=n)  # holds the mapping while it lives
            ptr = buf.ctypes.data
            rc = self._call(self._rt.cudaHostRegister, ptr, n, 0)
            if rc == 0:
                self.registered += 1
                weakref.finalize(buf, self._unpin, ptr, region)  # runs before numpy lets the mapping go
                return buf
            if rc != HOST_MEMORY_ALREADY_REGISTERED:
                if not self.failures:
                    logger.warning(
                        "k3 host tier: cudaHostRegister of %d bytes failed (CUDA error %d); using pageable buffers",
                        n,
                        rc,
                    )
                self.failures += 1
                return buf
            if not self.stale_ranges:
                logger.warning(
                    "k3 host tier: cudaHostRegister found a fresh mapping's range already registered (CUDA error %d); "
                    "keeping that mapping out of use and taking another",
                    rc,
                )
            self.stale_ranges += 1
            del buf
            self.held.append(region)
        self.failures += 1
        return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8, count=n)

    def _unpin(self, ptr: int, region: mmap.mmap) -> None:
        """The buffer at ``ptr`` is gone (a finalizer: it may run inside any allocation of any
        thread, the garbage collector's doing): unregister it on the pin thread, then let its
        mapping go (the closure holds it until then), or keep the mapping if the driver refused."""

        def run() -> None:
            if int(self._rt.cudaHostUnregister(ptr)) != 0:
                self.unregister_failures += 1
                self.held.append(region)

        self._pin.post(run)


def host_buffers_for(device: torch.device):
    """The host tier's ``alloc`` for a server whose pools live on ``device``: pinned on CUDA."""
    return PinnedHostMemory() if device.type == "cuda" else bytearray


def _view(flat: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return flat.view(dtype).reshape(tuple(shape))


def _to_device(parts: Sequence, device: torch.device) -> torch.Tensor:
    """The concatenation of ``parts`` (host buffers, or uint8 tensors on ``device``) as one uint8
    tensor on ``device``. Copies from page-locked host buffers are asynchronous (stream-ordered
    before whatever reads the result)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(list(parts))
    sizes = [_nbytes(p) for p in parts]
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    _copy_pieces(out.split(sizes), [p if isinstance(p, torch.Tensor) else _host(p) for p in parts])
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
        self._side = None  # CUDA: the streams a save's checksums and copies run on
        self.state_bytes = int(checkpoint_pool.bytes_per_slot)
        q = checkpoint_pool.q
        self._parts = [
            (t.dtype, tuple(t.shape[1:])) for t in (q, checkpoint_pool.scale, checkpoint_pool.conv) if t is not None
        ]
        self.layout = (
            f"kv={self.kv_dtype}x{len(self.kv)}x{self.kv_token_shape};"
            f"state={';'.join(f'{d}{s}' for d, s in self._parts)}"
        )

    def _streams(self) -> tuple:
        """CUDA: the streams a save's checksums and its copies down run on."""
        if self._side is None:
            self._side = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._side

    def _index(self, indices: Sequence[int]) -> torch.Tensor:
        """``indices`` on the device. Via numpy (``torch.tensor`` of a list costs 60 ns a token)
        and page-locked memory: a copy up from pageable memory first waits for the stream, so
        each save would wait for the previous save's copies to land."""
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def read_payloads(self, parts: Sequence[tuple], outs: Sequence):
        """Gather the bytes of ``parts`` on the device, launch their checksums and start the copies
        down into ``outs``, consecutive pieces of those bytes (one tier object's payload each).
        ``parts``, in byte order: ``("kv", token indices)`` (KV, token-major) and ``("state",
        handle)`` (a checkpoint's parts). Returns the :data:`~sglang_k3.tiers.ports.PendingRead`
        (on CPU the copies are done already)."""
        kv_parts = [np.asarray(x, dtype=np.int64) for kind, x in parts if kind == "kv"]
        rows = np.concatenate(kv_parts) if kv_parts else np.zeros(0, dtype=np.int64)
        kv = torch.empty(0, dtype=torch.uint8, device=self.device)
        if rows.size:
            idx = self._index(rows)
            kv = _flat_bytes(torch.stack([b.index_select(0, idx) for b in self.kv], dim=1))
        pieces, off, tb = [], 0, self.kv_token_bytes
        for kind, x in parts:
            if kind == "kv":
                pieces.append(kv[off : off + len(x) * tb])
                off += len(x) * tb
            elif kind == "state":
                pieces.extend(_flat_bytes(p) for p in self.pool.slot_parts(x))
            else:
                raise ValueError(f"unknown part {kind!r}")
        src = torch.cat(pieces) if pieces else kv
        sizes = [memoryview(o).nbytes for o in outs]
        if sum(sizes) != src.numel():
            raise ValueError(f"{src.numel()} bytes to write into {sum(sizes)}")
        if not src.is_cuda:
            _copy_pieces([_host(o) for o in outs], src.split(sizes))
            return device_checksums(src, _offsets(sizes), sizes)
        # The checksums and the copies down run on streams of their own, after the gather: the
        # caller's stream (the forward's) never queues behind the link, and the next read's
        # gather does not wait for this one's copies.
        gathered = torch.cuda.Event()
        gathered.record()
        side, copy = self._streams()
        with torch.cuda.stream(side):
            checks = device_checksums(src, _offsets(sizes), sizes, after=gathered)
        with torch.cuda.stream(copy):
            copy.wait_event(gathered)
            _copy_pieces([_host(o) for o in outs], src.split(sizes))
            landed = torch.cuda.Event()
            landed.record(copy)
        src.record_stream(side)
        src.record_stream(copy)

        def wait() -> list[int]:
            landed.synchronize()
            return checks()

        return wait

    def load_payloads(
        self,
        payloads: Sequence,
        checks: Sequence[int],
        kv_spans: Sequence[tuple[int, int, int]],
        new_kv: Sequence[int],
        state_span: tuple[int, int, int],
        handle: int,
    ) -> Optional[bool]:
        """Copy the objects' ``payloads`` up into one device tensor, verify each against its
        ``checks`` there, and only then write the KV of ``new_kv`` (the concatenation of the
        ``(payload, start, end)`` byte spans ``kv_spans``) and the state (``state_span``) into
        fresh slot ``handle``. None: a checksum failed, nothing was written; False: the pool
        refused the state (non-finite). While the copies run the host prepares the checksum
        launch and the KV index, so one wait covers them all."""
        sizes = [memoryview(p).nbytes for p in payloads]
        offsets = _offsets(sizes)
        data = _to_device(payloads, self.device)  # asynchronous from page-locked host buffers
        pending = device_checksums(data, offsets, sizes)  # after the copies, in stream order
        idx = self._index(new_kv) if len(new_kv) else None
        if pending() != list(checks):
            return None
        if idx is not None:
            kv = [data[offsets[i] + a : offsets[i] + b] for i, a, b in kv_spans]
            self._scatter_kv(idx, len(new_kv), kv)
        i, a, b = state_span
        return self.write_state(handle, data[offsets[i] + a : offsets[i] + b])

    def _scatter_kv(self, idx: torch.Tensor, n: int, parts: Sequence) -> None:
        data = _to_device(parts, self.device)
        if data.numel() != n * self.kv_token_bytes:
            raise ValueError(f"{data.numel()} KV bytes for {n} tokens of {self.kv_token_bytes}")
        t = _view(data, self.kv_dtype, (n, len(self.kv), *self.kv_token_shape))
        for layer, buf in enumerate(self.kv):
            buf.index_copy_(0, idx, t[:, layer])

    def read_state(self, handle: int, out: memoryview) -> None:
        """The checkpoint in ``handle`` (``state_bytes``) into ``out``, synchronously."""
        if len(out) != self.state_bytes:
            raise ValueError(f"{len(out)} bytes for a checkpoint of {self.state_bytes}")
        self.read_payloads([("state", handle)], [out])()

    def write_state(self, handle: int, data) -> bool:
        """``data`` (``state_bytes``, host bytes or a device tensor) into fresh slot ``handle``,
        sealed; False when the pool refuses it."""
        if len(data) != self.state_bytes:
            raise ValueError(f"{len(data)} state bytes, a checkpoint here is {self.state_bytes}")
        flat = _to_device([data], self.device)
        parts, off = [], 0
        for dtype, shape in self._parts:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            parts.append(_view(flat[off : off + n], dtype, shape))
            off += n
        return self.pool.load_parts(handle, parts)
