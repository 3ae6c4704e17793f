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

**Writes leave the scheduler's thread.** A save has the IO start copying the boundary's bytes off
the device into its new objects and compute their checksums on the device
(:meth:`~sglang_k3.tiers.ports.TierIO.read_payloads`: one gather, one checksum kernel, one copy per
object, nothing waited for; the device data may be freed at once). With ``write_queue_bytes`` over 0
(the server's default) one writer thread waits for those bytes to land, seals the objects with the
checksums and puts them into the tiers, blocks first, the boundary object last; with 0 the save does
that before it returns. A boundary is found by :meth:`TierManager.find` only once its object is in a
store, so a boundary whose write has not landed is never matched from a lower tier. A save never
waits: when the writes in flight already hold ``write_queue_bytes``, it is dropped and counted
(``tier_save_dropped``); the device's copy was going anyway. A load copies every part up and
verifies its checksum on the device before it writes a byte
(:meth:`~sglang_k3.tiers.ports.TierIO.load_payloads`).

The bytes are moved by a :class:`~sglang_k3.tiers.ports.TierIO` the host provides
(:mod:`sglang_k3.tiers.torch_io` for SGLang's pools): KV is read and written token-major,
``kv_token_bytes`` per token, so a block is sliced at any token. A save has the IO write straight
into the new objects' payloads and a load hands it the stored payloads as they are: no byte is
copied or read on the host besides the device move.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from sglang_k3.tiers import codec
from sglang_k3.tiers.copy_up import CopyUp
from sglang_k3.tiers.keys import BLOCK_TOKENS, Namespace, block_hashes, boundary_key, boundary_keys, kv_block_key
from sglang_k3.tiers.ports import TierCounters, TierIO, TierStore

logger = logging.getLogger(__name__)

# Boundary positions a lookup keys and asks the stores about at a time, deepest first: a block
# holds up to BLOCK_TOKENS of them, and the deepest is usually the one found.
_LOOKUP_POSITIONS = 64
# A batch of saves starts its read off the device each time this much is planned: the gather's
# device staging is bounded by it, and the link moves one group while the host plans the next.
# Not smaller: a group's launches cost about 0.6 ms of host time on an H100 host (the gather, the
# checksum kernel, the copies, the events), and 16 MiB groups (0.3 ms of link each) made a batch of
# eight 2k-token boundaries land later than one group did (benchmarks/GPU_NOTES.md).
_READ_GROUP_BYTES = 256 << 20

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


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
class _SaveJob:
    """One boundary's part of a batch of saves: what to put where, and what the IO reads."""

    todo: list  # (store, missing block indices)
    keys: list  # block keys of the path
    blanks: dict  # block index -> the new block object this save reads
    bkey: str
    tail: codec.Blank  # the boundary object
    pos: int
    nb: int  # whole blocks below pos
    kind: int
    held: bool  # some tier held the boundary already
    nbytes: int
    parts: list  # the IO's parts, in payload order
    outs: list  # the payloads they fill


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
        # a waiting request's boundary that lies in a lower tier is copied into the host tier
        self.copy_up = CopyUp(self.stores, self.counters, self._find)
        self.write_queue_bytes = write_queue_bytes
        self._writer = None
        self._writing: dict[str, int] = {}  # boundary key -> bytes, while its write is queued or running
        self._writing_bytes = 0
        self._write_lock = threading.Lock()

    # ------------------------------------------------------------------ save
    def save(self, tokens: Sequence[int], kv: Sequence[int], pos: int, handle: int, kind: int = 0) -> bool:
        """Write the boundary after ``pos`` tokens (state in ``handle``, KV of ``tokens[:pos]`` at
        ``kv``) to every tier that does not hold it. The device data must still be valid (call
        before the KV and the handle are freed). Returns whether some tier holds it now, or will
        once its queued write lands."""
        return self.save_many([(tokens, kv, pos, handle, kind)])[0]

    def save_many(self, boundaries: Sequence[tuple]) -> list[bool]:
        """:meth:`save` of each ``(tokens, kv, pos, handle, kind)``, as one write job: what an
        eviction that demotes several boundaries hands over at once. The reads off the device go
        in groups of at least ``_READ_GROUP_BYTES`` (one gather, one checksum launch and the copies
        per group), each started as soon as it is planned."""
        for tokens, kv, pos, _, _ in boundaries:
            if pos <= 0 or len(kv) < pos or len(tokens) < pos:
                raise ValueError(f"boundary {pos} needs {pos} tokens and KV indices")
        t0 = time.perf_counter()
        results: list = []
        jobs: list[_SaveJob] = []
        landings: list = []
        try:
            planned: set[str] = set()  # block keys an earlier boundary of this batch reads
            batch_bytes = group_bytes = 0
            group: list[_SaveJob] = []
            for i, (tokens, kv, pos, handle, kind) in enumerate(boundaries):
                job = self._plan_save(tokens, kv, pos, handle, int(kind), planned, batch_bytes)
                results.append(job)
                if isinstance(job, _SaveJob):
                    jobs.append(job)
                    group.append(job)
                    batch_bytes += job.nbytes
                    group_bytes += job.nbytes
                if group and (group_bytes >= _READ_GROUP_BYTES or i == len(boundaries) - 1):
                    parts = [p for j in group for p in j.parts]
                    landings.append(self.io.read_payloads(parts, [o for j in group for o in j.outs]))
                    group, group_bytes = [], 0
        except BaseException:
            for wait in landings:  # copies in flight write into the new objects: let them land first
                wait()
            raise
        finally:
            self.counters.save_seconds += time.perf_counter() - t0

        def landing() -> list[int]:
            return [c for wait in landings for c in wait()]

        if not jobs:
            return results
        if not self.write_queue_bytes:
            wrote = iter(self._write(jobs, landing))
            out = []
            for r in results:
                if isinstance(r, _SaveJob):
                    w = next(wrote)
                    if not w and r.held:
                        self.counters.save_skips += 1
                    r = w or r.held
                out.append(r)
            return out
        with self._write_lock:
            for j in jobs:
                self._writing[j.bkey] = j.nbytes
                self._writing_bytes += j.nbytes
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-tier-writer")
        self.counters.writes_queued += len(jobs)
        self._writer.submit(self._write, jobs, landing)
        return [True if isinstance(r, _SaveJob) else r for r in results]

    def _plan_save(self, tokens, kv, pos: int, handle: int, kind: int, planned: set, batch_bytes: int):
        """What a save of one boundary reads: the objects each tier lacks (the missing blocks,
        less those an earlier boundary of the batch reads, and the boundary object: its state and
        the KV past the last whole block), as the IO's parts and new objects' payloads. A bool
        when no write follows (True: some tier holds the boundary or its write is in flight; else
        whether one holds it though the queue was full)."""
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
        need = sorted({k for _, missing in todo for k in missing if keys[k] not in planned})
        nb, tb = len(hashes), self.io.kv_token_bytes
        nbytes = (len(need) * B + pos - nb * B) * tb + self.io.state_bytes
        if self.write_queue_bytes and self._writing_bytes + batch_bytes + nbytes > self.write_queue_bytes:
            self.counters.save_dropped += 1  # never wait for the writer: this copy is not kept below
            return held
        planned.update(keys[k] for k in need)
        blanks = {k: self._blank(0, B * tb) for k in need}
        tail = self._blank(self.io.state_bytes, (pos - nb * B) * tb)
        rows = np.asarray(kv[:pos], dtype=np.int64)  # one conversion, then whole blocks by index
        parts = [("kv", rows[: nb * B].reshape(nb, B)[need].reshape(-1)), ("state", handle), ("kv", rows[nb * B :])]
        outs = [blanks[k].payload for k in need] + [tail.payload]
        return _SaveJob(todo, keys, blanks, bkey, tail, pos, nb, kind, held, nbytes, parts, outs)

    def _write(self, jobs: list, landing) -> list[bool]:
        """Wait for the bytes a batch of saves read, seal the objects with the checksums the IO
        computed and put each boundary into every tier in its ``todo``, blocks first, the
        boundary object last (in the writer thread, or inline when writes are synchronous)."""
        t0 = time.perf_counter()
        B, c = self.block, self.counters
        wrote = [False] * len(jobs)
        sealed: dict[str, codec.Buffer] = {}  # block objects by key, across the batch
        put: set[tuple[str, str]] = set()  # (store, block key) put by this batch
        try:
            checks = iter(landing())
            for i, j in enumerate(jobs):
                for k, b in j.blanks.items():
                    sealed[j.keys[k]] = codec.seal(b, j.keys[k], codec.KV_BLOCK, (k + 1) * B, B, check=next(checks))
                blob = codec.seal(j.tail, j.bkey, codec.BOUNDARY, j.pos, j.pos - j.nb * B, j.kind, check=next(checks))
                for store, missing in j.todo:
                    ok = True
                    for k in missing:
                        if (store.name, j.keys[k]) in put:  # an earlier boundary of the batch put it
                            continue
                        if not store.put(j.keys[k], sealed[j.keys[k]]):
                            ok = False
                            break
                        put.add((store.name, j.keys[k]))
                        c.saved_kv_blocks += 1
                    if ok and store.put(j.bkey, blob):
                        wrote[i] = True
                    else:
                        c.save_failures += 1
                c.saves += wrote[i]
        except Exception:
            c.save_failures += 1
            logger.exception("k3 tier: writing %d boundaries failed; what was not put is not kept below", len(jobs))
        finally:
            c.write_seconds += time.perf_counter() - t0
            with self._write_lock:
                for j in jobs:
                    self._writing_bytes -= self._writing.pop(j.bkey, 0)
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

    # ------------------------------------------------------------------ prefetch (tiers/copy_up.py)
    def prefetch(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> bool:
        """For a waiting request: start copying into the host tier (the first store) the parts of
        the deepest boundary past ``floor`` that only a lower tier holds. Returns whether a copy
        started (not when there is no host tier above another, nothing to copy, or one running)."""
        return self.copy_up.start(tokens, floor, cap, device_kv)[1]

    def copying_up(self, tokens: Sequence[int], floor: int, cap: int, device_kv: int) -> Optional[str]:
        """:meth:`prefetch`, returning the key of the boundary whose copy into host memory runs
        now (started by this call or an earlier one), or None when none runs for it."""
        return self.copy_up.start(tokens, floor, cap, device_kv)[0]

    @property
    def copies_up(self) -> bool:
        """Whether a host tier sits above another tier (:attr:`CopyUp.possible`)."""
        return self.copy_up.possible

    def copy_running(self, key: str) -> bool:
        return self.copy_up.running(key)

    def wait_copy_up(self, timeout: float) -> bool:
        return self.copy_up.wait_one(timeout)

    def wait_prefetches(self, timeout: float = 30.0) -> bool:
        return self.copy_up.wait_all(timeout)

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
            for c in range(0, len(window), _LOOKUP_POSITIONS):  # deepest first, a slice at a time
                part = window[c : c + _LOOKUP_POSITIONS]
                wkeys = boundary_keys(self.ns, tokens, part, hashes, B)
                best: Optional[tuple[int, str, TierStore]] = None
                for store in self.stores:
                    for p, key, there in zip(part, wkeys, store.exists(wkeys)):
                        if there and (best is None or p > best[0]):
                            best = (p, key, store)
                            break  # deepest first
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
        try:  # the payload's checksum is verified by the IO, on the device (load)
            return codec.decode(key, blob, self.io.kv_token_bytes, self.io.state_bytes, verify=False)
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
        objs = []
        for j, key, store in plan.blocks:
            obj = self._fetch(store, key)
            if obj is None or obj.kind != codec.KV_BLOCK or obj.pos != (j + 1) * B:
                return None
            objs.append(obj)
        obj = self._fetch(plan.store, plan.key)
        if obj is None or obj.kind != codec.BOUNDARY or obj.pos != plan.pos:
            return None
        objs.append(obj)
        # the KV past kv_from: the blocks' (the first may start on the device), then the tail's
        sb, last = obj.state_bytes, len(objs) - 1
        spans = [
            (i, min(len(o.payload), max(0, plan.kv_from - j * B) * tb), len(o.payload))
            for i, ((j, _, _), o) in enumerate(zip(plan.blocks, objs))
        ]
        spans.append((last, sb + max(0, plan.kv_from - (plan.pos - obj.kv_tokens)) * tb, len(obj.payload)))
        if sum(b - a for _, a, b in spans) != len(new_kv) * tb:
            self.counters.incomplete += 1
            return None
        wrote = self.io.load_payloads(
            [o.payload for o in objs], [o.check for o in objs], spans, new_kv, (last, 0, sb), handle
        )
        if not wrote:
            self.counters.invalid_objects += 1
            if wrote is None:
                logger.warning(
                    "k3 tier %s: boundary %s failed its checksum; treated as a miss", plan.store.name, plan.key
                )
            return None
        nbytes = sum(len(o.payload) for o in objs)
        c = self.counters
        c.loads += 1
        c.load_kv_tokens += len(new_kv)
        c.load_bytes += nbytes
        c.load_seconds += time.perf_counter() - t0
        self.hits_by_tier[plan.store.name] += 1
        started = self.copy_up.landed(plan.key)
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
