"""What moves between the device and the lower tiers, and how a lookup finds it. Torch-free.

The tree (:mod:`sglang_k3.cache.tree`) knows nothing of tiers. The lifecycle calls two verbs:

* :meth:`TierManager.save` when a boundary leaves the device (an evicted checkpoint, with the KV
  of its path still in place), or earlier under a write-through policy. It writes the KV blocks
  below the boundary that a tier does not hold yet, then the boundary object (the state and the
  KV past the last whole block), in that order, to every tier (host, then Mooncake).
* :meth:`TierManager.find` and :meth:`TierManager.load` when a request is admitted: the deepest
  boundary past the device's own restore point whose state *and* KV are all there (on the device
  or in some tier), then its bytes, checked (:mod:`sglang_k3.tiers.codec`) before anything is
  written: the caller inserts the KV into the tree and registers the state as a ready checkpoint,
  and the device lookup that follows restores from it.

A reader never restores half a boundary: the boundary object goes last and carries the state
with the tail KV, every KV block it needs is looked up before, and every object is validated
before the first byte lands; a part missing or invalid is a miss there, and the next shallower
boundary is tried. Upstream's hybrid HiCache bugs are the cases this rules out: states pruned on
device eviction (sglang#33713: here the eviction itself saves them), a host hit restoring a wrong
state (#39830: key, layout and checksum are checked), and prefixes reported as hits that cannot
restore (#39147: a hit is reported only after the state and all the KV loaded).

**Writes leave the scheduler's thread** (``write_queue_bytes`` over 0, the server's default): a
save reads the boundary's bytes off the device into its new objects at once (the device data is
freed right after), and one writer thread seals them (checksums) and puts them into the tiers,
blocks first, the boundary object last. A boundary is found by :meth:`TierManager.find` only once
its object is in a store, so a boundary whose write has not landed is never matched from a lower
tier. A save never waits: when the writes in flight already hold ``write_queue_bytes``, it is
dropped and counted (``tier_save_dropped``); the device's copy was going anyway.

The bytes are moved by a :class:`TierIO` the host provides (:mod:`sglang_k3.tiers.torch_io` for
SGLang's pools): KV is read and written token-major, ``kv_token_bytes`` per token, so a block is
sliced at any token. A save has the IO write straight into the new objects' payloads and a load
hands it the stored payloads as they are: no byte is copied on the host besides the device move.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Optional, Protocol, Sequence

from sglang_k3.tiers import codec
from sglang_k3.tiers.keys import BLOCK_TOKENS, Namespace, block_hashes, boundary_key, kv_block_key

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


class TierStore(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def put(self, key: str, blob: bytes) -> bool: ...

    def stats(self) -> dict[str, int]: ...


class TierIO(Protocol):
    kv_token_bytes: int  # MLA KV of one token, every MLA layer
    state_bytes: int  # one checkpoint (every KDA layer, its own dtype)
    layout: str  # what the bytes mean, for the key's namespace

    def read_kv(self, indices: Sequence[int], outs: Sequence[memoryview]) -> None:
        """Write the KV of ``indices`` (token-major) across ``outs``, in order: ``outs`` cut the
        ``len(indices) * kv_token_bytes`` bytes into consecutive pieces."""

    def write_kv(self, indices: Sequence[int], parts: Sequence[codec.Bytes]) -> None:
        """The KV of ``indices`` is the concatenation of ``parts``."""

    def read_state(self, handle: int, out: memoryview) -> None:
        """Write the checkpoint in ``handle`` (``state_bytes``) into ``out``."""

    def write_state(self, handle: int, data: codec.Bytes) -> bool:
        """Load ``data`` into the checkpoint slot ``handle``; False when the pool refuses it."""


@dataclass
class TierPlan:
    """Where the deepest restorable boundary past the device's is: ``pos``, its boundary object in
    ``store``, and the KV blocks ``blocks`` = (index, key, store) not on the device."""

    pos: int
    key: str
    store: TierStore
    kv_from: int  # tokens below this are on the device already
    blocks: list = field(default_factory=list)


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
    find_seconds: float = 0.0  # hashing the prompt and asking the tiers
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


class TierManager:
    def __init__(
        self,
        stores: Sequence[TierStore],
        ns: Namespace,
        io: TierIO,
        write_policy: str = "write_back",
        block: int = BLOCK_TOKENS,
        write_queue_bytes: int = 0,
    ) -> None:
        """``write_queue_bytes``: 0 writes each save before it returns; over 0, one writer thread
        writes, with at most this many bytes in flight (a save beyond it is dropped)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"tier write policy {write_policy!r}: choose one of {', '.join(WRITE_POLICIES)}")
        if not stores:
            raise ValueError("a tier manager needs at least one store")
        self.stores = list(stores)
        self.ns, self.io, self.block = ns, io, block
        self.write_policy = write_policy
        # new objects go into the host tier's spare buffers where it has them (HostStore.blank)
        self._blank = getattr(self.stores[0], "blank", codec.new)
        self.counters = TierCounters()
        self.hits_by_tier = {s.name: 0 for s in self.stores}
        self.hit_tokens_by_tier = {s.name: 0 for s in self.stores}
        # Prefetch (best effort, SGLang's default storage prefetch policy): a waiting request's
        # boundary that lies in a lower tier is copied into the host tier by one background
        # thread, so its admission loads from host memory; admission never waits for it.
        self._executor = None
        self.write_queue_bytes = write_queue_bytes
        self._writer = None
        self._writing: dict[str, int] = {}  # boundary key -> bytes, while its write is queued or running
        self._writing_bytes = 0
        self._write_lock = threading.Lock()
        self._inflight: dict[str, float] = {}  # boundary key -> start of its copy
        self._prefetched: dict[str, float] = {}  # copied up, not loaded yet (oldest first, bounded)

    # ------------------------------------------------------------------ save
    def save(self, tokens: Sequence[int], kv: Sequence[int], pos: int, handle: int, kind: int = 0) -> bool:
        """Write the boundary after ``pos`` tokens (state in ``handle``, KV of ``tokens[:pos]`` at
        ``kv``) to every tier that does not hold it. The device data must still be valid (call
        before the KV and the handle are freed). Returns whether some tier holds it now, or will
        once its queued write lands."""
        if pos <= 0 or len(kv) < pos or len(tokens) < pos:
            raise ValueError(f"boundary {pos} needs {pos} tokens and KV indices")
        t0 = time.perf_counter()
        try:
            read = self._read_for_save(tokens, kv, pos, handle, kind)
        finally:
            self.counters.save_seconds += time.perf_counter() - t0
        if isinstance(read, bool):
            return read  # decided without a write: held already, in flight, or dropped
        job, held, nbytes = read
        if not self.write_queue_bytes:
            wrote = self._write(*job)
            if not wrote and held:
                self.counters.save_skips += 1
            return wrote or held
        bkey = job[3]
        with self._write_lock:
            self._writing[bkey] = nbytes
            self._writing_bytes += nbytes
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-tier-writer")
        self.counters.writes_queued += 1
        self._writer.submit(self._write, *job)
        return True

    def _read_for_save(self, tokens, kv, pos: int, handle: int, kind: int):
        """The caller's part of a save: find what each tier lacks and read it off the device into
        new objects. Returns the write job ``(args of _write, held, bytes)``, or a bool when no
        write follows (True: some tier holds the boundary or its write is in flight; else whether
        one holds it though the queue was full)."""
        B = self.block
        hashes = block_hashes(tokens, pos, B)
        bkey = boundary_key(self.ns, tokens, pos, hashes, B)
        if bkey in self._writing:  # a write of this boundary is in flight already
            self.counters.save_skips += 1
            return True
        keys = [kv_block_key(self.ns, h) for h in hashes]
        todo = []  # (store, missing block indices) for every store that lacks the boundary
        for store in self.stores:
            if store.exists([bkey])[0]:
                continue
            todo.append((store, [k for k, there in enumerate(store.exists(keys)) if not there]))
        held = len(todo) < len(self.stores)
        if not todo:
            self.counters.save_skips += 1
            return True
        # one read for everything any tier lacks, straight into the objects: the missing blocks
        # and the boundary (its state and the KV past the last whole block)
        need = sorted({k for _, missing in todo for k in missing})
        nb, tb = len(hashes), self.io.kv_token_bytes
        nbytes = (len(need) * B + pos - nb * B) * tb + self.io.state_bytes
        if self.write_queue_bytes and self._writing_bytes + nbytes > self.write_queue_bytes:
            self.counters.save_dropped += 1  # never wait for the writer: this copy is not kept below
            return held
        rows = [i for k in need for i in kv[k * B : (k + 1) * B]] + list(kv[nb * B : pos])
        blanks = {k: self._blank(0, B * tb) for k in need}
        tail = self._blank(self.io.state_bytes, (pos - nb * B) * tb)
        self.io.read_kv(rows, [blanks[k].kv for k in need] + [tail.kv])
        self.io.read_state(handle, tail.state)
        return (todo, keys, blanks, bkey, tail, (pos, nb, int(kind))), held, nbytes

    def _write(self, todo, keys, blanks, bkey: str, tail, meta) -> bool:
        """Seal the objects a save read and put them into every tier in ``todo``, the boundary
        object last (in the writer thread, or inline when writes are synchronous)."""
        t0 = time.perf_counter()
        pos, nb, kind = meta
        B, c = self.block, self.counters
        wrote = False
        try:
            block = {k: codec.seal(b, keys[k], codec.KV_BLOCK, (k + 1) * B, B) for k, b in blanks.items()}
            blob = codec.seal(tail, bkey, codec.BOUNDARY, pos, pos - nb * B, kind)
            for store, missing in todo:
                ok = True
                for k in missing:
                    if not store.put(keys[k], block[k]):
                        ok = False
                        break
                    c.saved_kv_blocks += 1
                if ok and store.put(bkey, blob):
                    wrote = True
                else:
                    c.save_failures += 1
            if wrote:
                c.saves += 1
        except Exception:
            c.save_failures += 1
            logger.exception("k3 tier: writing the boundary %s failed; it is not kept below", bkey)
        finally:
            c.write_seconds += time.perf_counter() - t0
            with self._write_lock:
                self._writing_bytes -= self._writing.pop(bkey, 0)
        return wrote

    def wait_writes(self, timeout: float = 30.0) -> bool:
        """Block until no write is queued or running (tests, shutdown); False on timeout."""
        deadline = time.perf_counter() + timeout
        while self._writing and time.perf_counter() < deadline:
            time.sleep(0.002)
        return not self._writing

    def holds(self, tokens: Sequence[int], pos: int) -> bool:
        """Whether some tier holds the boundary object after ``pos`` tokens (its KV unchecked), or
        its write is in flight (not to be written twice; :meth:`find` does not see it yet)."""
        key = boundary_key(self.ns, tokens, pos, block_hashes(tokens, pos, self.block), self.block)
        return key in self._writing or any(store.exists([key])[0] for store in self.stores)

    # ------------------------------------------------------------------ find / load
    def find(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> Optional[TierPlan]:
        """The deepest boundary in ``(floor, cap]`` whose state is in a tier and whose KV is on
        the device (``[0, device_kv)``) or in some tier, or None."""
        if cap <= floor:
            return None
        t0 = time.perf_counter()
        self.counters.lookups += 1
        try:
            plan = self._find(tokens, floor, cap, device_kv)
        finally:
            self.counters.find_seconds += time.perf_counter() - t0
        if plan is not None:
            self.counters.found += 1
        return plan

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> bool:
        """For a waiting request: start copying into the host tier (the first store) the parts of
        the deepest boundary past ``floor`` that only a lower tier holds. Returns whether a copy
        started (not when there is no host tier above another, nothing to copy, or one running)."""
        host = self.stores[0]
        if len(self.stores) < 2 or host.name != "host" or cap <= floor:
            return False
        plan = self._find(tokens, floor, cap, device_kv)
        if plan is None or plan.key in self._inflight:
            return False
        parts = [(key, store) for _, key, store in plan.blocks if store is not host]
        if plan.store is not host:
            parts.append((plan.key, plan.store))  # the boundary last, as a save writes it
        if not parts:
            return False
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-tier-prefetch")
        self._inflight[plan.key] = time.perf_counter()
        self.counters.prefetches += 1
        self._executor.submit(self._copy_up, host, plan.key, parts)
        return True

    def _copy_up(self, host: TierStore, bkey: str, parts: list) -> None:
        t0 = time.perf_counter()
        c = self.counters
        try:
            for key, store in parts:
                blob = store.get(key)
                if not blob or not host.put(key, blob):
                    c.prefetch_failures += 1
                    return
                c.prefetch_objects += 1
                c.prefetch_bytes += len(blob)
            self._prefetched[bkey] = self._inflight.get(bkey, t0)
            while len(self._prefetched) > 4096:
                self._prefetched.pop(next(iter(self._prefetched)))
        except Exception:
            c.prefetch_failures += 1
            logger.exception("k3 tier: prefetch of %s failed", bkey)
        finally:
            c.prefetch_seconds += time.perf_counter() - t0
            self._inflight.pop(bkey, None)

    def wait_prefetches(self, timeout: float = 30.0) -> bool:
        """Block until no prefetch runs (tests, shutdown); False on timeout."""
        deadline = time.perf_counter() + timeout
        while self._inflight and time.perf_counter() < deadline:
            time.sleep(0.005)
        return not self._inflight

    def _find(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> Optional[TierPlan]:
        B = self.block
        hashes = block_hashes(tokens, cap, B)
        first = min(device_kv, cap) // B  # the first block not wholly on the device
        keys = [kv_block_key(self.ns, h) for h in hashes[first:]]
        src: list[Optional[TierStore]] = [None] * len(keys)
        for store in self.stores:
            missing = [i for i, s in enumerate(src) if s is None]
            if not missing:
                break
            for i, there in zip(missing, store.exists([keys[i] for i in missing])):
                if there:
                    src[i] = store
        reach = first
        while reach - first < len(src) and src[reach - first] is not None:
            reach += 1
        hi = min(cap, reach * B + B - 1)  # a boundary's own object holds its KV past the last block
        for k in range(hi // B, floor // B - 1, -1):
            window = [p for p in range(min(hi, k * B + B - 1), max(floor, k * B - 1), -1) if p > 0]
            if not window:
                continue
            wkeys = [boundary_key(self.ns, tokens, p, hashes, B) for p in window]
            best: Optional[tuple[int, str, TierStore]] = None
            for store in self.stores:
                for p, key, there in zip(window, wkeys, store.exists(wkeys)):
                    if there and (best is None or p > best[0]):
                        best = (p, key, store)
                        break  # the window is deepest first
            if best is not None:
                p, key, store = best
                blocks = [(j, keys[j - first], src[j - first]) for j in range(first, p // B)]
                return TierPlan(pos=p, key=key, store=store, kv_from=min(device_kv, p), blocks=blocks)
        return None

    def _fetch(self, store: TierStore, key: str) -> Optional[codec.Decoded]:
        blob = store.get(key)
        if blob is None or len(blob) == 0:
            self.counters.incomplete += 1
            return None
        try:
            return codec.decode(key, blob, self.io.kv_token_bytes, self.io.state_bytes)
        except codec.InvalidObject as e:
            self.counters.invalid_objects += 1
            logger.warning("k3 tier %s: object %s rejected (%s); treated as a miss", store.name, key, e)
            return None

    def load(self, plan: TierPlan, new_kv: Sequence[int], handle: int) -> Optional[int]:
        """Copy the KV of ``[plan.kv_from, plan.pos)`` into ``new_kv`` and the state into
        ``handle``, after every part is fetched and validated. Returns the boundary's checkpoint
        kind flags, or None when some part is missing or invalid (nothing was written)."""
        B, tb = self.block, self.io.kv_token_bytes
        if len(new_kv) != plan.pos - plan.kv_from:
            raise ValueError(f"{len(new_kv)} KV slots for {plan.pos - plan.kv_from} tokens")
        t0 = time.perf_counter()
        parts: list[memoryview] = []
        nbytes = 0
        for j, key, store in plan.blocks:
            obj = self._fetch(store, key)
            if obj is None or obj.kind != codec.KV_BLOCK or obj.pos != (j + 1) * B:
                return None
            nbytes += len(obj.kv)
            parts.append(obj.kv[max(0, plan.kv_from - j * B) * tb :])
        obj = self._fetch(plan.store, plan.key)
        if obj is None or obj.kind != codec.BOUNDARY or obj.pos != plan.pos:
            return None
        tail_start = plan.pos - obj.kv_tokens
        parts.append(obj.kv[max(0, plan.kv_from - tail_start) * tb :])
        if sum(len(p) for p in parts) != len(new_kv) * tb:
            self.counters.incomplete += 1
            return None
        if new_kv:
            self.io.write_kv(new_kv, parts)
        if not self.io.write_state(handle, obj.state):
            self.counters.invalid_objects += 1
            return None
        c = self.counters
        c.loads += 1
        c.load_kv_tokens += len(new_kv)
        c.load_bytes += nbytes + len(obj.kv) + len(obj.state)
        c.load_seconds += time.perf_counter() - t0
        self.hits_by_tier[plan.store.name] += 1
        started = self._prefetched.pop(plan.key, None)
        if started is not None and plan.store is self.stores[0]:
            c.prefetch_hits += 1
            c.prefetch_lead_seconds += time.perf_counter() - started
        return obj.checkpoint_kind

    def count_gain(self, plan: TierPlan, tokens: int) -> None:
        """A loaded boundary became the request's restore point, ``tokens`` past the device's own."""
        self.counters.load_tokens += tokens
        self.hit_tokens_by_tier[plan.store.name] += tokens

    def note_no_memory(self) -> None:
        """A boundary was found below but not brought up: the device had no room for it now."""
        self.counters.load_no_memory += 1

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d.update({f"tier_{name}_hits": n for name, n in self.hits_by_tier.items()})
        d.update({f"tier_{name}_hit_tokens": n for name, n in self.hit_tokens_by_tier.items()})
        for s in self.stores:
            d.update(s.stats())
        return d
