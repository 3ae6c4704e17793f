"""The host tier: lower-tier objects in this process's memory, under a byte budget, LRU.

Objects are immutable, as in Mooncake: a put on a key already held keeps the old object (and
counts as a use). When a put does not fit, the least recently used objects go; an object larger
than the whole budget is refused. A boundary whose KV blocks were evicted here is found
incomplete at lookup and not restored (the tier manager checks every part).

On CPU the host tier is plain process memory. On CUDA the objects are bytes too: moving them
to and from the device is the tier IO's job (:mod:`sglang_k3.tiers.torch_io`). Torch-free.

**Recycled buffers.** Writing into freshly allocated memory costs a page fault per 4 KiB page: on
the H200 host a save spent more time allocating its objects (about 1.8 GB/s) than moving them over
the link. So an object this store drops (evicted, removed, cleared) keeps its buffer as a spare,
and :meth:`blank` hands a spare of the same size to the next object the tier manager builds: KV
block objects all have one size, and a boundary object's size varies only with its tail. Spares
count against the budget with the objects (``used + spare <= budget`` at all times: the tier never
holds more memory than its budget, and a put drops spares before it evicts objects). A spare is
handed out only while no object holds it, and the manager overwrites every byte of it (header,
state and KV) before it is stored again. Objects that arrive as ``bytes`` (copied up from
Mooncake) are immutable and are not recycled.

**Where new buffers come from:** ``alloc(n)``, a ``bytearray`` by default; on CUDA the server
passes :class:`sglang_k3.tiers.torch_io.PinnedHostMemory`, page-locked buffers the device copies
at the host link's rate.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

from sglang_k3.tiers import codec


@dataclass
class StoreCounters:
    """What a tier store did, lifetime (reported as ``tier_<name>_<field>``)."""

    puts: int = 0  # objects written
    put_bytes: int = 0
    put_refused: int = 0  # larger than the budget, or the backend said no
    gets: int = 0
    get_hits: int = 0
    get_bytes: int = 0
    evictions: int = 0  # objects dropped to make room
    evicted_bytes: int = 0
    recycled: int = 0  # objects built in a spare buffer (no fresh memory)

    def as_dict(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_{f.name}": getattr(self, f.name) for f in fields(self)}


class HostStore:
    recycles = True  # keep dropped objects' buffers as spares (the replay's modelled store: no)

    def __init__(self, budget_bytes: int, name: str = "host", alloc: Callable[[int], codec.Buffer] = bytearray) -> None:
        self.name = name
        self._alloc = alloc
        if budget_bytes <= 0:
            raise ValueError(f"host tier budget must be > 0 bytes (got {budget_bytes})")
        self.budget_bytes = int(budget_bytes)
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._charged: dict[str, int] = {}
        self._state: dict[str, int] = {}  # of each object's charge, the checkpoint's bytes
        self.used_bytes = 0
        self.held_state_bytes = 0
        self._spares: defaultdict[int, list[codec.Buffer]] = defaultdict(list)  # by size
        self.spare_bytes = 0
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # the prefetcher writes from its own thread

    def blank(self, state_bytes: int, kv_bytes: int) -> codec.Blank:
        """A new object's buffer (:func:`codec.new`), a spare one of that size if there is one."""
        n = codec.HEADER_BYTES + state_bytes + kv_bytes
        with self._lock:
            spares = self._spares.get(n)
            buf = spares.pop() if spares else None
            if buf is not None:
                if not spares:
                    del self._spares[n]
                self.spare_bytes -= n
                self.counters.recycled += 1
        return codec.new(state_bytes, kv_bytes, self._alloc(n) if buf is None else buf)

    def _drop(self, blob, reserve: int = 0) -> None:
        """``blob`` left the store: keep its buffer as a spare if the budget has room for it
        beside the objects, the spares and ``reserve`` bytes about to be stored."""
        n = len(blob)
        room = self.budget_bytes - self.used_bytes - self.spare_bytes - reserve
        if self.recycles and not isinstance(blob, bytes) and n <= room:
            self._spares[n].append(blob)
            self.spare_bytes += n

    def _free_spares(self, need: int) -> None:
        """Drop spares until ``need`` more bytes fit beside the objects and the spares."""
        while self.spare_bytes and self.used_bytes + self.spare_bytes + need > self.budget_bytes:
            n, bufs = next(iter(self._spares.items()))
            bufs.pop()
            self.spare_bytes -= n
            if not bufs:
                del self._spares[n]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are held; a key found counts as a use (as a Mooncake lookup leases it)."""
        with self._lock:
            return self._exists(keys)

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for k in keys:
            there = k in self._objects
            if there:
                self._objects.move_to_end(k)
            out.append(there)
        return out

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._get(key)

    def _get(self, key: str) -> Optional[bytes]:
        self.counters.gets += 1
        blob = self._objects.get(key)
        if blob is not None:
            self._objects.move_to_end(key)
            self.counters.get_hits += 1
            self.counters.get_bytes += self._charged[key]
        return blob

    def charge(self, blob: bytes) -> int:
        """Bytes an object counts against the budget: its size (the trace replay charges the
        modelled size of an object whose payload it does not materialise)."""
        return len(blob)

    def state_charge(self, blob: bytes) -> int:
        """Of :meth:`charge`, the bytes of the KDA state (the rest is MLA KV and the header)."""
        return codec.peek(blob)[1] if len(blob) >= codec.HEADER_BYTES else 0

    def put(self, key: str, blob: bytes) -> bool:
        with self._lock:
            return self._put(key, blob)

    def _put(self, key: str, blob: bytes) -> bool:
        if key in self._objects:
            self._objects.move_to_end(key)
            return True
        size = self.charge(blob)
        if size > self.budget_bytes:
            self.counters.put_refused += 1
            return False
        self._free_spares(size)
        while self.used_bytes + size > self.budget_bytes:
            old, old_blob = self._objects.popitem(last=False)
            freed = self._charged.pop(old)
            self.used_bytes -= freed
            self.held_state_bytes -= self._state.pop(old)
            self.counters.evictions += 1
            self.counters.evicted_bytes += freed
            self._drop(old_blob, reserve=size)
        self._objects[key] = blob
        self._charged[key] = size
        self._state[key] = self.state_charge(blob)
        self.used_bytes += size
        self.held_state_bytes += self._state[key]
        self.counters.puts += 1
        self.counters.put_bytes += size
        return True

    def remove(self, key: str) -> bool:
        with self._lock:
            blob = self._objects.pop(key, None)
            if blob is None:
                return False
            self.used_bytes -= self._charged.pop(key)
            self.held_state_bytes -= self._state.pop(key)
            self._drop(blob)
            return True

    def clear(self) -> None:
        with self._lock:
            blobs = list(self._objects.values())
            self._objects.clear()
            self._charged.clear()
            self._state.clear()
            self.used_bytes = 0
            self.held_state_bytes = 0
            for blob in blobs:
                self._drop(blob)

    def __len__(self) -> int:
        return len(self._objects)

    def stats(self) -> dict[str, int]:
        d = self.counters.as_dict(f"tier_{self.name}")
        d[f"tier_{self.name}_bytes"] = self.used_bytes
        d[f"tier_{self.name}_spare_bytes"] = self.spare_bytes
        # a pinning allocator's counts (CUDA)
        for field in ("registered", "failures", "stale_ranges", "unregister_failures"):
            if hasattr(self._alloc, field):
                d[f"tier_{self.name}_pin_{field}"] = getattr(self._alloc, field)
        d[f"tier_{self.name}_state_bytes"] = self.held_state_bytes
        d[f"tier_{self.name}_objects"] = len(self._objects)
        d[f"tier_{self.name}_budget_bytes"] = self.budget_bytes
        return d
