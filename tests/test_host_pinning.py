"""The host tier's page-locked buffers (``PinnedHostMemory``) against a driver's registration
rules, on CPU.

The CUDA runtime is replaced by :class:`Driver`, which keeps the driver's registration table the
way the real one behaves (page-granular ranges; ``cudaErrorHostMemoryAlreadyRegistered``, 712,
for a range that overlaps a registered one; ``cudaErrorHostMemoryNotRegistered``, 713, for an
unknown pointer) and records the thread of each call. What is under test is the allocator's
handling of those answers, seen on an H200 and an H100: a refusal must never reach the thread
that launches kernels, a range the driver holds is never used, and a mapping the driver may
still hold is never unmapped.
"""

from __future__ import annotations

import gc
import mmap
import threading

import numpy as np

from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.torch_io import HOST_MEMORY_ALREADY_REGISTERED, PinnedHostMemory

NOT_REGISTERED = 713
PAGE = mmap.PAGESIZE


class Driver:
    """The runtime's ``cudaHostRegister`` / ``cudaHostUnregister`` over a registration table."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int]] = {}  # ptr -> [first page, last page + 1)
        self.threads: set[int] = set()
        self.stale_next = 0  # the next N registrations find their range registered (a leaked one)
        self.refuse_unregister: set[int] = set()
        self.fail_next_with = 0

    def _pages(self, ptr: int, n: int) -> tuple[int, int]:
        return ptr // PAGE, -(-(ptr + n) // PAGE)

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 (the runtime's name)
        self.threads.add(threading.get_ident())
        if self.fail_next_with:
            rc, self.fail_next_with = self.fail_next_with, 0
            return rc
        lo, hi = self._pages(ptr, n)
        if self.stale_next:  # the driver kept an earlier registration of this address range
            self.stale_next -= 1
            self.ranges[-ptr] = (lo, hi)
        if any(a < hi and lo < b for a, b in self.ranges.values()):
            return HOST_MEMORY_ALREADY_REGISTERED
        self.ranges[ptr] = (lo, hi)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.threads.add(threading.get_ident())
        if ptr in self.refuse_unregister or ptr not in self.ranges:
            return NOT_REGISTERED
        del self.ranges[ptr]
        return 0


def _settle(pin: PinnedHostMemory) -> None:
    gc.collect()
    pin._pin.call(lambda: None)  # the unregistrations queued before it have run


def _mapped(region: mmap.mmap) -> bool:
    return not region.closed and len(region) > 0


def test_registrations_run_on_a_thread_that_launches_nothing_and_are_undone_when_freed():
    drv = Driver()
    pin = PinnedHostMemory(runtime=drv)
    bufs = [pin(n) for n in (1, PAGE, 3 * PAGE + 5, 1_216_572)]
    assert [b.nbytes for b in bufs] == [1, PAGE, 3 * PAGE + 5, 1_216_572]
    assert all(b.ctypes.data % PAGE == 0 for b in bufs)
    assert pin.registered == 4 and pin.failures == 0 and len(drv.ranges) == 4
    assert threading.get_ident() not in drv.threads and len(drv.threads) == 1
    bufs[2][:] = 7  # writable, its own pages
    del bufs
    _settle(pin)
    assert drv.ranges == {} and pin.unregister_failures == 0 and pin.held == []
    assert threading.get_ident() not in drv.threads and len(drv.threads) == 1


def test_a_range_the_driver_holds_registered_is_kept_out_of_use_and_another_is_taken():
    drv = Driver()
    pin = PinnedHostMemory(runtime=drv)
    drv.stale_next = 1
    buf = pin(100_000)
    assert pin.stale_ranges == 1 and pin.registered == 1 and pin.failures == 0
    (stale,) = pin.held
    assert _mapped(stale)  # never unmapped, so the address is not handed out again
    stale_ptr = np.frombuffer(stale, dtype=np.uint8).ctypes.data
    assert buf.ctypes.data != stale_ptr
    assert buf.ctypes.data in drv.ranges  # the buffer in use is the one registered
    # every attempt refused: a pageable buffer, counted, and the refused mappings all kept
    drv.stale_next = PinnedHostMemory.ATTEMPTS
    plain = pin(5000)
    assert plain.nbytes == 5000 and plain.ctypes.data not in drv.ranges
    assert pin.failures == 1 and pin.stale_ranges == 1 + PinnedHostMemory.ATTEMPTS
    assert len(pin.held) == 1 + PinnedHostMemory.ATTEMPTS and all(map(_mapped, pin.held))


def test_a_refused_unregistration_keeps_the_mapping_and_other_refusals_leave_a_pageable_buffer():
    drv = Driver()
    pin = PinnedHostMemory(runtime=drv)
    buf = pin(PAGE * 2)
    drv.refuse_unregister.add(buf.ctypes.data)
    del buf
    _settle(pin)
    assert pin.unregister_failures == 1 and len(pin.held) == 1 and _mapped(pin.held[0])
    drv.fail_next_with = 2  # cudaErrorMemoryAllocation: not retried
    buf = pin(PAGE)
    assert pin.failures == 1 and pin.stale_ranges == 0 and buf.ctypes.data not in drv.ranges
    buf[:] = 1


def test_the_host_store_reports_the_allocators_counts():
    drv = Driver()
    pin = PinnedHostMemory(runtime=drv)
    store = HostStore(1 << 20, alloc=pin)
    drv.stale_next = 1
    store.blank(100, 1000)
    stats = store.stats()
    assert stats["tier_host_pin_registered"] == 1
    assert stats["tier_host_pin_stale_ranges"] == 1
    assert stats["tier_host_pin_unregister_failures"] == 0
    assert stats["tier_host_pin_failures"] == 0


class _Cycle:
    """A buffer in a reference cycle: freed only by the cyclic collector, inside whatever
    allocation triggers it."""

    def __init__(self, buf) -> None:
        self.buf, self.me = buf, self


def test_buffers_the_collector_frees_during_registrations_never_stop_the_allocating_thread():
    """A buffer's finalizer posts its unregistration from inside a garbage collection, which runs
    inside any allocation, including those made while a registration is handed to the pin
    thread. With an executor's ``submit`` (its lock held while it allocated) such a collection
    deadlocked the allocating thread, seen on an H100. Here the collector runs at every
    allocation and each collection finds a freshly dropped buffer in a cycle to free: every
    registration returns, and every freed buffer is unregistered."""
    drv = Driver()
    pin = PinnedHostMemory(runtime=drv)
    spare = [pin(PAGE) for _ in range(2000)]
    done: list[int] = []

    def make_garbage(phase: str, info: dict) -> None:
        if phase == "start" and spare:
            _Cycle(spare.pop())  # freed by the collection about to run, inside some allocation

    def allocate() -> None:
        keep = [pin(PAGE) for _ in range(200)]
        done.append(len(keep))

    old = gc.get_threshold()
    gc.callbacks.append(make_garbage)
    gc.set_threshold(1, 1, 1)
    try:
        worker = threading.Thread(target=allocate, daemon=True)
        worker.start()
        worker.join(30)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(make_garbage)
    assert not worker.is_alive(), "an allocation never returned: a finalizer blocked its thread"
    assert done == [200] and pin.registered == 2200 and pin.failures == 0
    spare.clear()
    gc.collect()
    _settle(pin)
    assert drv.ranges == {} and pin.unregister_failures == 0  # the ones kept went with their thread


_EXIT_SCRIPT = """
import sys, threading, time
from sglang_k3.tiers.torch_io import PinnedHostMemory

class SlowDriver:
    # the runtime's calls take a while, as cudaHostUnregister does; each is reported when done
    def cudaHostRegister(self, ptr, n, flags):
        return 0
    def cudaHostUnregister(self, ptr):
        time.sleep(0.02)
        sys.stdout.write("unregistered\\n")
        sys.stdout.flush()
        return 0

pin = PinnedHostMemory(runtime=SlowDriver())
kept = [pin(4096) for _ in range(%d)]  # alive until the interpreter exits
print("allocated", flush=True)
"""


def test_buffers_alive_at_exit_are_all_unregistered_before_the_interpreter_finalizes():
    """Buffers still alive when the process ends are unregistered by their finalizers, run at
    exit. Each is handed to the pin thread; with a daemon thread that nobody waited for, the
    interpreter finalized while the thread was inside such a call (on an H100: the process
    aborted at exit, status 134, and on CPU most unregistrations never ran). The pin thread's
    ``atexit`` hook runs what it was handed before it ends: every buffer is unregistered and the
    process exits cleanly."""
    import subprocess
    import sys

    n = 20
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT % n], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "allocated"
    assert lines.count("unregistered") == n, out.stdout
