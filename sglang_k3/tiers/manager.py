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

**Writes leave the scheduler's thread.** A save has the IO gather the boundary's bytes on the
device and start their checksums there (:meth:`~sglang_k3.tiers.ports.TierIO.read_payloads`: one
gather, one checksum kernel and the copies per group of boundaries, nothing waited for; the device
data may be freed at once). With ``write_queue_bytes`` over 0 (the server's default) each group goes
to the writer thread (:mod:`sglang_k3.tiers.writer`), which waits for its bytes to land, seals the
objects with the checksums and puts them into the tiers, blocks first, the boundary object last;
with 0 the save does that before it returns. A boundary is found by
:meth:`TierManager.find` only once its object is in a store, so a boundary whose write has not
landed is never matched from a lower tier. A save never waits: when the writes in flight already
hold ``write_queue_bytes``, it is dropped and counted (``tier_save_dropped``); the device's copy
was going anyway. A load copies every part up and
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
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from sglang_k3.tiers import codec
from sglang_k3.tiers.copy_up import CopyUp
from sglang_k3.tiers.keys import (
    BLOCK_TOKENS,
    Namespace,
    block_hashes,
    boundary_key,
    boundary_keys,
    extend_block_hashes,
    kv_block_key,
)
from sglang_k3.tiers.ports import TierCounters, TierIO, TierStore
from sglang_k3.tiers.writer import SaveJob, TierWriter

logger = logging.getLogger(__name__)

# Boundary positions a lookup keys and asks the stores about at a time, deepest first: a block
# holds up to BLOCK_TOKENS of them, and the deepest is usually the one found.
_LOOKUP_POSITIONS = 64
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


class TierManager:
    # A batch of saves starts a group's read off the device (gather, checksums, copies) and hands
    # it to the writer each time this much is planned; the gather's device staging is bounded by
    # it. Not smaller: a group's launches cost the caller about 0.6 ms of host time, and smaller
    # groups made a batch of eight 2k-token boundaries land later than one group did on H100s (16
    # MiB: seventh session; 32 MiB: 0.40 of the link against 0.46, fifteenth; benchmarks/GPU_NOTES.md).
    READ_GROUP_BYTES = 256 << 20
    # A lookup asks the tiers about this many KV blocks past the device's first, then twice as
    # many past those while all were found, and so on (:meth:`_find`).
    LOOKUP_BLOCKS = 32

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
        self.writer = TierWriter(self.counters, block, write_queue_bytes)

    # ------------------------------------------------------------------ save
    def save(self, tokens: Sequence[int], kv: Sequence[int], pos: int, handle: int, kind: int = 0) -> bool:
        """Write the boundary after ``pos`` tokens (state in ``handle``, KV of ``tokens[:pos]`` at
        ``kv``) to every tier that does not hold it. The device data must still be valid (call
        before the KV and the handle are freed). Returns whether some tier holds it now, or will
        once its queued write lands."""
        return self.save_many([(tokens, kv, pos, handle, kind)])[0]

    def save_many(self, boundaries: Sequence[tuple]) -> list[bool]:
        """:meth:`save` of each ``(tokens, kv, pos, handle, kind)``, as one write job: what an
        eviction that demotes several boundaries hands over at once. Boundaries are planned in
        groups of about ``READ_GROUP_BYTES``; each group's read off the device starts as soon as
        it is planned, and the group goes to the writer (:mod:`sglang_k3.tiers.writer`), which
        puts it below once it has landed."""
        for tokens, kv, pos, _, _ in boundaries:
            if pos <= 0 or len(kv) < pos or len(tokens) < pos:
                raise ValueError(f"boundary {pos} needs {pos} tokens and KV indices")
        t0 = time.perf_counter()
        w = self.writer
        results: list = []
        groups: list = []  # (jobs, pending read), inline writes only
        stream = None
        try:
            planned: set[str] = set()  # block keys an earlier boundary of this batch reads
            group: list[SaveJob] = []
            group_bytes = 0  # planned, not handed over yet: counted against the queue
            for i, (tokens, kv, pos, handle, kind) in enumerate(boundaries):
                job = self._plan_save(tokens, kv, pos, handle, int(kind), planned, group_bytes)
                results.append(job)
                if isinstance(job, SaveJob):
                    group.append(job)
                    group_bytes += job.nbytes
                if group and (group_bytes >= self.READ_GROUP_BYTES or i == len(boundaries) - 1):
                    parts, outs = [p for j in group for p in j.parts], [o for j in group for o in j.outs]
                    read = self.io.read_payloads(parts, outs)
                    if w.queued:
                        if stream is None:
                            stream = w.open()
                        stream.hand_over(group, read)
                    else:
                        groups.append((group, read))
                    group, group_bytes = [], 0
        except BaseException:
            for _, read in groups:  # copies in flight write into the new objects: let them land first
                read()
            raise
        finally:
            if stream is not None:
                stream.close()
            self.counters.save_seconds += time.perf_counter() - t0
        if w.queued or not groups:
            return [True if isinstance(r, SaveJob) else r for r in results]
        wrote = iter(w.write_now(groups))
        out = []
        for r in results:
            if isinstance(r, SaveJob):
                ok = next(wrote)
                if not ok and r.held:
                    self.counters.save_skips += 1
                r = ok or r.held
            out.append(r)
        return out

    def _plan_save(self, tokens, kv, pos: int, handle: int, kind: int, planned: set, batch_bytes: int):
        """What a save of one boundary reads: the objects each tier lacks (the missing blocks,
        less those an earlier boundary of the batch reads, and the boundary object: its state and
        the KV past the last whole block), as the IO's parts and new objects' payloads. A bool
        when no write follows (True: some tier holds the boundary or its write is in flight; else
        whether one holds it though the queue was full). ``batch_bytes``: planned before it in
        this batch and not handed to the writer yet."""
        B = self.block
        hashes = block_hashes(tokens, pos, B)
        bkey = boundary_key(self.ns, tokens, pos, hashes, B)
        if self.writer.writing(bkey):  # a write of this boundary is in flight already
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
        if self.writer.queued and not self.writer.fits(batch_bytes + nbytes):
            self.counters.save_dropped += 1  # never wait for the writer: this copy is not kept below
            return held
        planned.update(keys[k] for k in need)
        blanks = {k: self._blank(0, B * tb) for k in need}
        tail = self._blank(self.io.state_bytes, (pos - nb * B) * tb)
        rows = np.asarray(kv[:pos], dtype=np.int64)  # one conversion, then whole blocks by index
        parts = [("kv", rows[: nb * B].reshape(nb, B)[need].reshape(-1)), ("state", handle), ("kv", rows[nb * B :])]
        outs = [blanks[k].payload for k in need] + [tail.payload]
        return SaveJob(todo, keys, blanks, bkey, tail, pos, nb, kind, held, nbytes, parts, outs)

    def wait_writes(self, timeout: float = 30.0) -> bool:
        """Block until no write is queued or running (tests, shutdown); False on timeout."""
        return self.writer.wait(timeout)

    def holds(self, tokens: Sequence[int], pos: int) -> bool:
        """Whether some tier holds the boundary object after ``pos`` tokens (its KV unchecked), or
        its write is in flight (not to be written twice; :meth:`find` does not see it yet)."""
        key = boundary_key(self.ns, tokens, pos, block_hashes(tokens, pos, self.block), self.block)
        return self.writer.writing(key) or any(store.exists([key])[0] for store in self.stores)

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
        n = min(cap, len(tokens)) // B
        first = min(device_kv, cap) // B  # the first block not wholly on the device
        hashes = block_hashes(tokens, first * B, B)  # chained into every key past them
        # The KV blocks past the device's, in windows that double, until one is missing from
        # every tier: only blocks up to there are ever used, so a long prompt with little below
        # is not hashed to its end (a 48k-token prompt was 2 ms of hashing at each admission).
        keys: list[str] = []
        src: list[Optional[TierStore]] = []
        reach, ask = first, self.LOOKUP_BLOCKS
        while reach == first + len(src) and len(hashes) < n:
            extend_block_hashes(tokens, hashes, min(n, len(hashes) + ask) * B, B)
            ask *= 2
            new = [kv_block_key(self.ns, h) for h in hashes[first + len(keys) :]]
            found: list[Optional[TierStore]] = [None] * len(new)
            for store in self.stores:
                missing = [i for i, s in enumerate(found) if s is None]
                if not missing:
                    break
                for i, there in zip(missing, store.exists([new[i] for i in missing])):
                    if there:
                        found[i] = store
            keys += new
            src += found
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
