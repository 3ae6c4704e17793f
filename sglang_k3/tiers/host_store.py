"""The host tier: lower-tier objects in this process's memory, under a byte budget, LRU.

Objects are immutable, as in Mooncake: a put on a key already held keeps the old object (and
counts as a use). When a put does not fit, the least recently used objects go; an object larger
than the whole budget is refused. A boundary whose KV blocks were evicted here is found
incomplete at lookup and not restored (the tier manager checks every part).

On CPU the host tier is plain process memory. On CUDA the objects are bytes too: moving them
to and from the device is the tier IO's job (:mod:`sglang_k3.tiers.torch_io`). Torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Optional, Sequence

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

    def as_dict(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_{f.name}": getattr(self, f.name) for f in fields(self)}


class HostStore:
    def __init__(self, budget_bytes: int, name: str = "host") -> None:
        self.name = name
        if budget_bytes <= 0:
            raise ValueError(f"host tier budget must be > 0 bytes (got {budget_bytes})")
        self.budget_bytes = int(budget_bytes)
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._charged: dict[str, int] = {}
        self._state: dict[str, int] = {}  # of each object's charge, the checkpoint's bytes
        self.used_bytes = 0
        self.held_state_bytes = 0
        self.counters = StoreCounters()
        self._lock = threading.Lock()  # the prefetcher writes from its own thread

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
        while self.used_bytes + size > self.budget_bytes:
            old, _ = self._objects.popitem(last=False)
            freed = self._charged.pop(old)
            self.used_bytes -= freed
            self.held_state_bytes -= self._state.pop(old)
            self.counters.evictions += 1
            self.counters.evicted_bytes += freed
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
            if self._objects.pop(key, None) is None:
                return False
            self.used_bytes -= self._charged.pop(key)
            self.held_state_bytes -= self._state.pop(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._charged.clear()
            self._state.clear()
            self.used_bytes = 0
            self.held_state_bytes = 0

    def __len__(self) -> int:
        return len(self._objects)

    def stats(self) -> dict[str, int]:
        d = self.counters.as_dict(f"tier_{self.name}")
        d[f"tier_{self.name}_bytes"] = self.used_bytes
        d[f"tier_{self.name}_state_bytes"] = self.held_state_bytes
        d[f"tier_{self.name}_objects"] = len(self._objects)
        d[f"tier_{self.name}_budget_bytes"] = self.budget_bytes
        return d
