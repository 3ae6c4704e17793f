"""Putting saved boundaries into the tiers as their bytes land: the tier manager's writer. Torch-free.

A batch of saves (:meth:`TierManager.save_many <sglang_k3.tiers.manager.TierManager.save_many>`)
reaches the writer in **groups**: the manager plans boundaries until a group holds
``READ_GROUP_BYTES``, has the IO gather the group's bytes on the device and start copying them down
(:meth:`~sglang_k3.tiers.ports.TierIO.read_payloads`), and hands the group over. The writer thread
takes the groups in order and, once a group's bytes have landed, seals each object with the
checksum the IO computed and puts it into every tier that lacks it, the KV blocks first and the
boundary object last (:func:`seal_and_put`); the group's boundaries then stop counting as in
flight, so a batch of several groups is found below, and frees the queue's bytes, group by group.
With no queue (``queue_bytes`` 0) the manager writes each batch before it returns, through the
same :func:`seal_and_put`.

**What is in flight** (:meth:`TierWriter.writing`): a boundary from the moment its group is handed
over until its group was put. A lookup does not find it below (its object is not in a store yet:
invariant 2, applied to the tiers), and a second save of it is skipped. A save never waits for
the writer: one that would take the bytes in flight past ``queue_bytes`` is dropped and counted by
the manager (:meth:`TierWriter.fits`).

**Who launches the copies: the caller.** Launching them from the writer thread instead (so that
the caller could plan the next group meanwhile) was measured on an H200 and made the caller
slower, not faster: with a group per boundary the caller took 9.7-13.7 ms for eight 2k-token
boundaries against 2.8-4.2 ms in one group, the two threads taking the GIL from each other at
every torch call (``benchmarks/GPU_NOTES.md``, fifteenth session). What bounds the moves is the
host's Python work per boundary, not its overlap with the link.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from sglang_k3.tiers import codec
from sglang_k3.tiers.ports import PendingRead, TierCounters

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
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


@dataclass
class BatchPuts:
    """What the groups of one batch share: block objects sealed by an earlier boundary of the
    batch (a later one on the same path reads none of them again) and the (store, block key)
    pairs already put."""

    sealed: dict = field(default_factory=dict)
    put: set = field(default_factory=set)


def seal_and_put(jobs: list, checks: list, batch: BatchPuts, block: int, c: TierCounters) -> list[bool]:
    """Seal the objects of ``jobs`` (their bytes have landed; ``checks`` in payload order) and put
    each boundary into every tier in its ``todo``, blocks first, the boundary object last. Returns
    per job whether some tier took its boundary object."""
    wrote = [False] * len(jobs)
    it = iter(checks)
    for i, j in enumerate(jobs):
        for k, b in j.blanks.items():
            batch.sealed[j.keys[k]] = codec.seal(b, j.keys[k], codec.KV_BLOCK, (k + 1) * block, block, check=next(it))
        blob = codec.seal(j.tail, j.bkey, codec.BOUNDARY, j.pos, j.pos - j.nb * block, j.kind, check=next(it))
        for store, missing in j.todo:
            ok = True
            for k in missing:
                if (store.name, j.keys[k]) in batch.put:  # an earlier boundary of the batch put it
                    continue
                if not store.put(j.keys[k], batch.sealed[j.keys[k]]):
                    ok = False
                    break
                batch.put.add((store.name, j.keys[k]))
                c.saved_kv_blocks += 1
            if ok and store.put(j.bkey, blob):
                wrote[i] = True
            else:
                c.save_failures += 1
        c.saves += wrote[i]
    return wrote


class TierWriter:
    """The writes of saved boundaries: in one thread of their own with ``queue_bytes`` over 0,
    else inline. ``block``: tokens per KV block object."""

    def __init__(self, counters: TierCounters, block: int, queue_bytes: int) -> None:
        self.counters, self.block, self.queue_bytes = counters, block, queue_bytes
        self._executor = None  # the writer thread, started at the first queued batch
        self._writing: dict[str, int] = {}  # boundary key -> bytes, from hand-over until put
        self._writing_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when nothing is in flight

    @property
    def queued(self) -> bool:
        """Whether writes leave the caller's thread (else :meth:`write_now`)."""
        return self.queue_bytes > 0

    def writing(self, bkey: str) -> bool:
        return bkey in self._writing

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (planned, not handed over yet) stay within the queue's bound."""
        return self._writing_bytes + nbytes <= self.queue_bytes

    # ------------------------------------------------------------------ inline
    def write_now(self, groups: list[tuple[list, PendingRead]]) -> list[bool]:
        """Wait for each group's bytes and put it, in order (no queue): per job, whether some tier
        took it. A group that fails is counted and the next ones still land and are put."""
        batch = BatchPuts()
        return [ok for jobs, read in groups for ok in self._put(jobs, read, batch)]

    def _put(self, jobs: list, read: PendingRead, batch: BatchPuts) -> list[bool]:
        """Wait for one group's bytes and :func:`seal_and_put` it; a failure (its copies, a tier)
        is counted and logged, and what it had not put is not kept below."""
        t0 = time.perf_counter()
        try:
            return seal_and_put(jobs, read(), batch, self.block, self.counters)
        except Exception:
            self.counters.save_failures += 1
            logger.exception("k3 tier: writing %d boundaries failed; they are not kept below", len(jobs))
            return [False] * len(jobs)
        finally:
            self.counters.write_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ queued
    def open(self) -> "BatchStream":
        """A batch's stream of groups to the writer thread (:meth:`BatchStream.hand_over`, then
        :meth:`BatchStream.close`)."""
        stream = BatchStream(self)
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-tier-writer")
        self._executor.submit(self._drain, stream)
        return stream

    def _register(self, jobs: list) -> None:
        with self._lock:
            for j in jobs:
                self._writing[j.bkey] = j.nbytes
                self._writing_bytes += j.nbytes
        self.counters.writes_queued += len(jobs)

    def _release(self, jobs: list) -> None:
        with self._lock:
            for j in jobs:
                self._writing_bytes -= self._writing.pop(j.bkey, 0)
            if not self._writing:
                self._idle.notify_all()

    def _drain(self, stream: "BatchStream") -> None:
        """The writer thread's part of one batch: put each group once it has landed, in the order
        handed over (the copies run already; waiting on the oldest releases the GIL), and release
        its boundaries, whatever became of it."""
        batch = BatchPuts()
        while (item := stream.q.get()) is not None:
            jobs, read = item
            try:
                self._put(jobs, read, batch)
            finally:
                self._release(jobs)

    def wait(self, timeout: float = 30.0) -> bool:
        """Block until no write is handed over or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._writing, timeout)


class BatchStream:
    """The groups of one batch on their way to the writer thread, in order."""

    def __init__(self, writer: TierWriter) -> None:
        self.writer = writer
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def hand_over(self, jobs: list, read: PendingRead) -> None:
        """``jobs``' bytes are being gathered by ``read``: from now on the writer owns them."""
        self.writer._register(jobs)
        self.q.put((jobs, read))

    def close(self) -> None:
        """No more groups: the writer puts what it has and ends the batch."""
        self.q.put(None)
