"""``benchmarks.live.cache_timing``: the per-step cache timer the live A/B loads into its servers.
Here on plain objects (outermost calls only, sums over scheduler files, differences per step); the
live A/B's end-to-end test runs it inside real k3, upstream and cache-off servers."""

from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.live import cache_timing as ct  # noqa: E402


class Cache:
    def __init__(self):
        self.log = []

    def match_prefix(self, n):
        self.log.append("match")
        return self.evict(n) + 1  # a public method calling another: counted once

    def evict(self, n):
        t = time.thread_time()
        while time.thread_time() - t < 0.002 * n:
            pass
        self.log.append("evict")
        return n

    def _private(self):
        return "untimed"

    @property
    def size(self):
        return 3


def test_outermost_calls_are_timed_once(tmp_path):
    totals = ct._Totals(str(tmp_path))
    c = Cache()
    n = ct.wrap_cache(c, totals)
    assert n == 2  # match_prefix, evict: not the private method, not the property
    assert c.match_prefix(5) == 6 and c.size == 3 and c._private() == "untimed"
    assert c.evict(1) == 1
    assert totals.calls == 2 and totals.by_method["match_prefix"][0] == 1 and totals.by_method["evict"][0] == 1
    assert "evict" in totals.by_method and totals.cpu_ns >= 0.012e9 * 0.9  # 10 ms + 2 ms of CPU spun
    assert totals.by_method["match_prefix"][1] > totals.by_method["evict"][1]
    assert totals.wall_ns >= totals.cpu_ns * 0.5
    assert c.log == ["match", "evict", "evict"]


def test_read_sums_schedulers_and_per_step_takes_differences(tmp_path):
    a = {
        "pid": 1,
        "steps": 10,
        "calls": 40,
        "cpu_ns": 2_000_000,
        "wall_ns": 3_000_000,
        "by_method": {"evict": [4, 1_500_000]},
    }
    b = {
        "pid": 2,
        "steps": 30,
        "calls": 60,
        "cpu_ns": 6_000_000,
        "wall_ns": 7_000_000,
        "by_method": {"evict": [1, 500_000]},
    }
    for d in (a, b):
        (tmp_path / f"scheduler_{d['pid']}.json").write_text(json.dumps(d))
    (tmp_path / "scheduler_3.json.tmp").write_text("half-written")  # ignored
    tot = ct.read(str(tmp_path))
    assert tot["steps"] == 40 and tot["calls"] == 100 and tot["cpu_ns"] == 8_000_000
    assert tot["by_method"]["evict"] == [5, 2_000_000]
    zero = ct.read(str(tmp_path / "missing"))
    assert zero["steps"] == 0 and zero["by_method"] == {}
    d = ct.per_step(zero, tot)
    assert d["steps"] == 40 and d["cache_calls"] == 100
    assert d["cache_cpu_ms_per_step"] == 8_000_000 / 40 / 1e6 and d["cache_wall_ms_per_step"] == 10_000_000 / 40 / 1e6
    assert d["top_methods_cpu_ms"] == {"evict": 2.0}
    assert ct.per_step(tot, tot)["cache_cpu_ms_per_step"] is None  # no step between the two


def test_the_profile_covers_the_thread_with_nested_times(tmp_path, monkeypatch):
    """With ``SGLANG_K3_CACHE_PROFILE`` the scheduler thread runs under cProfile from the scheduler's
    start: the cache's calls and what runs between them are in the tables, an outer call's
    inclusive time holds the calls it makes, and profiling goes on after each write."""
    import pstats

    monkeypatch.setenv(ct.PROFILE_ENV, "1")
    totals = ct._Totals(str(tmp_path))
    c = Cache()
    ct.wrap_cache(c, totals)

    def outside_the_cache():
        return sum(range(1000))

    totals.start_profile()
    try:
        c.match_prefix(2)
        outside_the_cache()
        totals.write_profile()
        c.evict(1)
        totals.write_profile()
    finally:
        totals.profile.disable()
    base = os.path.join(str(tmp_path), f"scheduler_{os.getpid()}")
    stats = {f[2]: v for f, v in pstats.Stats(base + ".prof").stats.items()}
    assert {"match_prefix", "evict", "outside_the_cache"} <= set(stats)
    _, calls, own, cum, _ = stats["evict"]
    assert calls == 2 and cum >= 0.004  # both calls, the second after the first write: 2 + 4 ms spun
    assert stats["match_prefix"][3] >= 0.004 * 0.9 and stats["match_prefix"][3] >= stats["match_prefix"][2]
    with open(base + "_profile.txt") as f:
        text = f.read()
    assert "evict" in text and "cumulative" in text


def test_without_the_profile_variable_nothing_is_profiled(tmp_path, monkeypatch):
    monkeypatch.delenv(ct.PROFILE_ENV, raising=False)
    totals = ct._Totals(str(tmp_path))
    c = Cache()
    ct.wrap_cache(c, totals)
    c.match_prefix(1)
    assert totals.profile is None and not any(n.endswith(".prof") for n in os.listdir(tmp_path))


def _spin_a(n):
    t = time.thread_time()
    while time.thread_time() - t < 0.001 * n:
        pass


def _spin_b(n):
    t = time.thread_time()
    while time.thread_time() - t < 0.001 * n:
        pass


def test_profile_delta_is_one_phase_alone(tmp_path, monkeypatch):
    """A real cProfile over two phases, written by the timer's own ``write_profile``: the snapshot
    taken between them and the profile after give the second phase alone (``_spin_a`` ran only
    before the snapshot, ``_spin_b`` only after; both files are real pstats dumps)."""
    monkeypatch.setenv(ct.PROFILE_ENV, "1")
    totals = ct._Totals(str(tmp_path))
    totals.start_profile()
    for _ in range(5):
        _spin_a(4)
    totals.write_profile()
    snaps = ct.snapshot_profiles(str(tmp_path), "before_w")
    assert [os.path.basename(p) for p in snaps] == [f"scheduler_{os.getpid()}.before_w.prof"]
    for _ in range(3):
        _spin_b(6)
    totals.write_profile()
    totals.profile.disable()
    text = ct.profile_delta(snaps[0], str(tmp_path / f"scheduler_{os.getpid()}.prof"))
    rows = {ln.split()[-1].rsplit("(", 1)[-1][:-1]: ln.split() for ln in text.splitlines() if ln.endswith(")")}
    assert "_spin_a" not in rows  # all of it before the snapshot
    calls, cum = int(rows["_spin_b"][0]), float(rows["_spin_b"][2])
    assert calls == 3 and 0.015 <= cum <= 0.2  # 3 x 6 ms of CPU (its clock calls included), nothing of before
    # the second snapshot name filter: tagged copies are never taken as a scheduler's profile
    assert ct.snapshot_profiles(str(tmp_path), "after") == [str(tmp_path / f"scheduler_{os.getpid()}.after.prof")]
