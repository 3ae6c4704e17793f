"""What the tier manager (:mod:`sglang_k3.tiers.manager`) needs from a store and from the IO that
moves bytes on and off the device, and what it counts. Torch-free.

* :class:`TierStore`: the host store (:mod:`~sglang_k3.tiers.host_store`), Mooncake
  (:mod:`~sglang_k3.tiers.mooncake_store`), the replay's modelled stores;
* :class:`TierIO`: the server's pools (:mod:`~sglang_k3.tiers.torch_io`), the replay's
  ``SimTierIO`` (``benchmarks/policies/tiers.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Protocol, Sequence

from sglang_k3.tiers import codec


class TierStore(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def put(self, key: str, blob: bytes) -> bool: ...

    def stats(self) -> dict[str, int]: ...


# A read off the device into new objects' payloads (:meth:`TierIO.read_payloads`), its copies
# down running: calling it waits until the bytes are in the payloads and gives each payload's
# checksum (``k3sum64``), in order.
PendingRead = Callable[[], list[int]]


class TierIO(Protocol):
    kv_token_bytes: int  # MLA KV of one token, every MLA layer
    state_bytes: int  # one checkpoint (every KDA layer, its own dtype)
    layout: str  # what the bytes mean, for the key's namespace

    def read_payloads(self, parts: Sequence[tuple], outs: Sequence[memoryview]) -> PendingRead:
        """Gather the bytes of ``parts`` (in order: ``("kv", token indices)``, token-major KV, and
        ``("state", handle)``) for ``outs``, consecutive pieces of those bytes (one object's
        payload each), start their checksums and the copies into ``outs``, and return at once. The
        device data may be freed once this returns."""

    def load_payloads(
        self,
        payloads: Sequence[codec.Bytes],
        checks: Sequence[int],
        kv_spans: Sequence[tuple[int, int, int]],
        new_kv: Sequence[int],
        state_span: tuple[int, int, int],
        handle: int,
    ) -> Optional[bool]:
        """Verify each payload against its checksum on the device, then write the KV of
        ``new_kv`` (the ``(payload, start, end)`` byte spans ``kv_spans``, in order) and the state
        (``state_span``) into fresh slot ``handle``. None: a checksum failed and nothing was
        written; False: the pool refused the state."""


@dataclass
class TierCounters:
    saves: int = 0  # boundaries written to at least one tier
    save_skips: int = 0  # already there
    save_failures: int = 0  # a tier refused a part (full): that tier did not get the boundary
    saved_kv_blocks: int = 0
    save_seconds: float = 0.0  # on the caller's thread: keys, lookups, the read off the device
    save_dropped: int = 0  # not written: the writes in flight already held the queue's bytes
    writes_queued: int = 0  # saves handed to the writer thread
    write_seconds: float = 0.0  # sealing and putting, in the writer thread (or inline when synchronous)
    lookups: int = 0  # admissions that looked below the device
    found: int = 0  # a boundary deeper than the device's was found
    find_seconds: float = 0.0  # hashing the prompt and asking the tiers (admission, holds and prefetches)
    loads: int = 0  # and restored
    load_tokens: int = 0  # tokens of prefix gained over the device's own restore point
    load_kv_tokens: int = 0  # KV tokens copied up
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_no_memory: int = 0  # found, but no device memory for it now
    invalid_objects: int = 0  # failed validation: a miss, never restored
    incomplete: int = 0  # a part vanished between lookup and load
    prefetches: int = 0  # copies into the host tier started for a waiting request
    prefetch_objects: int = 0  # objects they copied up
    prefetch_bytes: int = 0
    prefetch_seconds: float = 0.0  # spent copying (in the prefetch thread)
    prefetch_failures: int = 0  # a part was gone or the host refused it
    prefetch_hits: int = 0  # loads served from the host tier because a prefetch put it there
    prefetch_lead_seconds: float = 0.0  # from those prefetches' start to the load (time in the queue)

    def as_dict(self) -> dict:
        return {f"tier_{f.name}": getattr(self, f.name) for f in fields(self)}
