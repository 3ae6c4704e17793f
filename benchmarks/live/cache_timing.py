"""The cache's CPU time per scheduling step, measured inside a live server, for any cache.

``benchmarks.live_ab --time-cache`` starts its servers with ``cache_timing_site/`` first on
``PYTHONPATH`` and ``SGLANG_K3_CACHE_TIMING_DIR`` set. Python imports that folder's
``sitecustomize`` in every interpreter; there it calls :func:`install`, which waits for SGLang's
scheduler module to be imported (a post-import hook, so nothing is imported earlier than SGLang
itself would) and then:

* wraps every public method of the scheduler's ``tree_cache`` object, whatever its class (k3's
  ``K3RadixCache``, upstream's ``UnifiedRadixCache``), counting the calling thread's CPU time
  (``time.thread_time_ns``) and wall time of the outermost call only (a method calling another
  counts once);
* counts scheduling steps (``Scheduler.run_batch`` calls);
* every quarter second (a daemon thread), and at exit, writes ``{pid, steps, calls, cpu_ns, wall_ns,
  by_method}`` to ``SGLANG_K3_CACHE_TIMING_DIR/scheduler_<pid>.json`` (written whole, then renamed).

With ``SGLANG_K3_CACHE_PROFILE`` set as well (``live_ab --profile-cache``), a ``cProfile`` runs
over the whole scheduler from the end of ``Scheduler.__init__`` (its thread; from Python 3.12,
where cProfile rides on ``sys.monitoring``, every thread of the process): the cache's calls and
everything SGLang does around them (the allocators the scheduler calls directly included), with
inclusive times that nest. Every two seconds, at the end of a cache call, and at exit it writes
``scheduler_<pid>.prof`` (``pstats``) and ``scheduler_<pid>_profile.txt`` (the top functions by
cumulative and by own time, and the cache's and allocators' functions). It slows the whole
scheduler, so the timings of a profiled run are not the server's.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Callable

ENV = "SGLANG_K3_CACHE_TIMING_DIR"
PROFILE_ENV = "SGLANG_K3_CACHE_PROFILE"
PROFILE_EVERY_S = 2.0
# the third table: the caches' and the KV allocators' own files
PROFILE_FOCUS = r"k3_cache|radix_cache|unified_memory|allocator|sglang_k3"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache_timing_site")
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
WRITE_EVERY_S = 0.25


class _Totals:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, f"scheduler_{os.getpid()}.json")
        self.steps = 0
        self.calls = 0
        self.cpu_ns = 0
        self.wall_ns = 0
        self.by_method: dict[str, list[int]] = {}  # name -> [calls, cpu_ns]
        self.depth = threading.local()
        self.profile = None  # a cProfile.Profile of the scheduler thread (PROFILE_ENV, start_profile)
        self.profiled_at = 0.0
        if os.environ.get(PROFILE_ENV):
            import cProfile

            self.profile = cProfile.Profile()

    def start_profile(self) -> None:
        """Profile the calling thread (the scheduler's) from now on."""
        self.profile.enable()
        self.profiled_at = time.monotonic()

    def write_profile(self) -> None:
        """The profile so far, as pstats and as text; profiling goes on afterwards."""
        import io
        import pstats

        prof = self.profile
        prof.disable()
        try:
            base = self.path[: -len(".json")]
            prof.dump_stats(base + ".prof.tmp")  # whole, then renamed: a snapshot never reads half
            os.replace(base + ".prof.tmp", base + ".prof")
            out = io.StringIO()
            st = pstats.Stats(prof, stream=out)
            st.sort_stats("cumulative").print_stats(40)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(PROFILE_FOCUS, 40)
            with open(base + "_profile.txt", "w") as f:
                f.write(out.getvalue())
        finally:
            self.profiled_at = time.monotonic()
            prof.enable()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "steps": self.steps,
                    "calls": self.calls,
                    "cpu_ns": self.cpu_ns,
                    "wall_ns": self.wall_ns,
                    "by_method": {k: list(v) for k, v in list(self.by_method.items())},
                },
                f,
            )
        os.replace(tmp, self.path)


def _timed(totals: _Totals, name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        d = getattr(totals.depth, "n", 0)
        if d:
            return fn(*args, **kwargs)
        totals.depth.n = 1
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu = time.thread_time_ns() - c0
            totals.depth.n = 0
            totals.calls += 1
            totals.cpu_ns += cpu
            totals.wall_ns += time.perf_counter_ns() - w0
            m = totals.by_method.setdefault(name, [0, 0])
            m[0] += 1
            m[1] += cpu
            if totals.profile is not None and time.monotonic() - totals.profiled_at > PROFILE_EVERY_S:
                totals.write_profile()

    return wrapper


def wrap_cache(cache: object, totals: _Totals) -> int:
    """Wrap the public bound methods of ``cache`` in place; returns how many."""
    n = 0
    for name in dir(type(cache)):
        if name.startswith("_"):
            continue
        attr = getattr(type(cache), name, None)
        if not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)):
            continue
        try:
            bound = getattr(cache, name)
        except Exception:  # noqa: BLE001 - a property that raises: not a method
            continue
        if callable(bound):
            setattr(cache, name, _timed(totals, name, bound))
            n += 1
    return n


def _patch_scheduler(module, out_dir: str) -> None:
    cls = module.Scheduler
    init, run_batch = cls.__init__, cls.run_batch
    totals = _Totals(out_dir)

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        n = wrap_cache(self.tree_cache, totals)
        print(f"[cache timing] {type(self.tree_cache).__name__}: {n} methods timed -> {totals.path}", file=sys.stderr)
        totals.write()
        atexit.register(totals.write)
        if totals.profile is not None:
            atexit.register(totals.write_profile)
            totals.start_profile()  # this thread runs the scheduler's event loop next

        def writer() -> None:
            while True:
                time.sleep(WRITE_EVERY_S)
                try:
                    totals.write()
                except OSError:
                    return

        threading.Thread(target=writer, name="cache-timing", daemon=True).start()

    def run_batch_counted(self, *args, **kwargs):
        totals.steps += 1
        return run_batch(self, *args, **kwargs)

    cls.__init__ = __init__
    cls.run_batch = run_batch_counted


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``callback(module)`` once ``name`` has been imported the normal way."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback, self._spec = name, callback, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._spec is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._spec = spec
        real = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self_inner, s):
                return real.create_module(s)

            def exec_module(self_inner, module):
                real.exec_module(module)
                self.callback(module)

        spec.loader = _Loader()
        return spec


def install() -> None:
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    sys.meta_path.insert(0, _AfterImport(SCHEDULER_MODULE, lambda m: _patch_scheduler(m, out_dir)))


def read(out_dir: str) -> dict:
    """The sums over a server's scheduler files (``{}`` keys zero when none was written yet)."""
    tot = {"steps": 0, "calls": 0, "cpu_ns": 0, "wall_ns": 0, "by_method": {}}
    if not os.path.isdir(out_dir):
        return tot
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith("scheduler_") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(out_dir, name)) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        for k in ("steps", "calls", "cpu_ns", "wall_ns"):
            tot[k] += int(d.get(k, 0))
        for m, (c, ns) in d.get("by_method", {}).items():
            cur = tot["by_method"].setdefault(m, [0, 0])
            cur[0] += c
            cur[1] += ns
    return tot


def per_step(before: dict, after: dict) -> dict:
    """The cache's time per scheduling step between two :func:`read` snapshots."""
    steps = after["steps"] - before["steps"]
    cpu = after["cpu_ns"] - before["cpu_ns"]
    wall = after["wall_ns"] - before["wall_ns"]
    methods = {
        m: [c - before["by_method"].get(m, [0, 0])[0], ns - before["by_method"].get(m, [0, 0])[1]]
        for m, (c, ns) in after["by_method"].items()
    }
    top = sorted(((ns, m, c) for m, (c, ns) in methods.items() if c), reverse=True)[:6]
    return {
        "steps": steps,
        "cache_calls": after["calls"] - before["calls"],
        "cache_cpu_ms_per_step": (cpu / steps / 1e6) if steps else None,
        "cache_wall_ms_per_step": (wall / steps / 1e6) if steps else None,
        "cache_cpu_s": cpu / 1e9,
        "top_methods_cpu_ms": {m: ns / 1e6 for ns, m, _c in top},
    }


def snapshot_profiles(out_dir: str, tag: str) -> list[str]:
    """Copy each scheduler's ``.prof`` as it stands to ``scheduler_<pid>.<tag>.prof`` (the profile
    so far: one workload's own time is the difference of two snapshots, :func:`profile_delta`).
    The profile is rewritten every ``PROFILE_EVERY_S`` at a cache call; wait that long after the
    part to be included before taking a snapshot. Returns the copies' paths."""
    import shutil

    out = []
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if name.startswith("scheduler_") and name.endswith(".prof") and name.count(".") == 1:
            dst = os.path.join(out_dir, f"{name[: -len('.prof')]}.{tag}.prof")
            shutil.copyfile(os.path.join(out_dir, name), dst)
            out.append(dst)
    return out


def profile_delta(before_path: str, after_path: str, top: int = 30) -> str:
    """What the scheduler did between two profile snapshots, as text: the functions by own time
    and by cumulative time spent between them (``pstats`` totals subtracted per function; calls
    that were running when a snapshot was taken are counted where they ended), and the cache's
    and allocators' own files (:data:`PROFILE_FOCUS`) on their own."""
    import pstats
    import re

    a = pstats.Stats(after_path).stats
    b = pstats.Stats(before_path).stats
    rows = []
    for fn, (_cc, nc, tt, ct, _callers) in a.items():
        nc0, tt0, ct0 = (b[fn][1], b[fn][2], b[fn][3]) if fn in b else (0, 0.0, 0.0)
        if nc - nc0 > 0:
            rows.append((fn, nc - nc0, tt - tt0, ct - ct0))

    def name(fn) -> str:
        return f"{fn[0]}:{fn[1]}({fn[2]})"

    def table(title: str, sel: list, key) -> list[str]:
        lines = [title, f"{'calls':>10} {'own s':>9} {'cum s':>9}  function"]
        for fn, n, tt, ct in sorted(sel, key=key, reverse=True)[:top]:
            lines.append(f"{n:>10} {tt:>9.4f} {ct:>9.4f}  {name(fn)}")
        return lines + [""]

    focus = [r for r in rows if re.search(PROFILE_FOCUS, r[0][0])]
    total = sum(r[2] for r in rows)
    out = [
        f"profile between {os.path.basename(before_path)} and {os.path.basename(after_path)}: "
        f"{total:.3f} s of own time in {len(rows)} functions",
        "",
    ]
    out += table("by own time", rows, lambda r: r[2])
    out += table("by cumulative time", rows, lambda r: r[3])
    out += table(f"the cache's and allocators' files ({PROFILE_FOCUS}), by cumulative time", focus, lambda r: r[3])
    return "\n".join(out)
