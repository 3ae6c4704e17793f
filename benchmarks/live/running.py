"""The most requests a server ran at once during a workload, read from its own Prometheus gauge
``sglang:num_running_reqs`` (the server needs ``--enable-metrics``), polled in the background."""

from __future__ import annotations

import re
import threading

import requests

_GAUGE = re.compile(r"^sglang:num_running_reqs(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def running_requests(url: str) -> float | None:
    """The gauge's current value (summed over label sets), or None when the server exports none."""
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return None
    vals = [float(v) for v in _GAUGE.findall(text)]
    return sum(vals) if vals else None


class RunningPeak:
    """``with RunningPeak(url) as p: ...`` then ``p.peak`` (None if the gauge was never seen)."""

    def __init__(self, url: str, interval_s: float = 0.1):
        self.url, self.interval_s = url, interval_s
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            v = running_requests(self.url)
            if v is not None:
                self.peak = v if self.peak is None else max(self.peak, v)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RunningPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
