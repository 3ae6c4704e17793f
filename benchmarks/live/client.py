"""A streaming ``/generate`` client that measures TTFT, and the per-workload metrics."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import requests


@dataclass
class Result:
    key: str  # identifies the request across servers (same key = same logical request)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list = field(default_factory=list)
    spec_correct_drafts: int = 0  # speculative decoding: drafts accepted, and verify steps run
    spec_verifies: int = 0
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None
    error: Optional[str] = None


def generate_stream(
    url: str,
    key: str,
    input_ids: list[int],
    max_new_tokens: int,
    timeout: float = 900.0,
    headers: Optional[dict] = None,
) -> Result:
    """Greedy ``POST /generate`` with ``stream: true``: TTFT is the time to the first chunk that
    carries an output token. ``headers``: e.g. a router's session key. Never raises; a failure is
    ``Result.error``."""
    res = Result(key=key)
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=timeout, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return res
            meta = None
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                ids = chunk.get("output_ids") or []
                meta = chunk.get("meta_info", {})
                if ids and res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
                # SGLang streams cumulative output_ids by default, increments with
                # --incremental-streaming-output; completion_tokens tells which.
                if len(ids) == meta.get("completion_tokens", -1) and len(ids) >= len(res.output_ids):
                    res.output_ids = list(ids)
                else:
                    res.output_ids.extend(ids)
            res.latency_s = time.perf_counter() - t0
            if meta is None:
                res.error = "empty stream"
                return res
            reason = meta.get("finish_reason") or {}
            if isinstance(reason, dict) and reason.get("type") == "abort":
                # e.g. a prompt longer than the server's context: its output ids are no answer
                res.error = f"aborted: {str(reason.get('message', ''))[:280]}"
                return res
            res.prompt_tokens = int(meta.get("prompt_tokens", len(input_ids)))
            res.cached_tokens = int(meta.get("cached_tokens") or 0)
            res.spec_correct_drafts = int(meta.get("spec_num_correct_drafts") or 0)
            res.spec_verifies = int(meta.get("spec_verify_ct") or 0)
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


def percentile(values: list, q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None when empty."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(
    ttfts: list,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    duration_s: float,
    requests_n: int,
    errors: int,
) -> dict:
    """The metrics of one (workload, cache) cell, all from measured numbers."""
    return {
        "requests": requests_n,
        "errors": errors,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "prefill_tokens": prompt_tokens - cached_tokens,
        "hit_rate": (cached_tokens / prompt_tokens) if prompt_tokens else None,
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "output_tok_per_s": (output_tokens / duration_s) if duration_s > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
    }


def per_request(results: list[Result]) -> list[dict]:
    """Each request on its own, in the order sent: a p90 over a few dozen requests rests on three
    or four of them, and which ones (a group's first, a restore inside a page) says why."""
    return [
        {
            "key": r.key,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "ttft_s": r.ttft_s,
            "latency_s": r.latency_s,
            "error": r.error,
        }
        for r in results
    ]


def summarize_results(results: list[Result], duration_s: float) -> dict:
    """:func:`summarize`, plus under speculative decoding the verify steps run and the mean
    accept length (tokens committed per verify: the accepted drafts and the target's own token;
    SGLang's ``spec_accept_length``), None without speculation."""
    ok = [r for r in results if r.error is None]
    out = summarize(
        [r.ttft_s for r in ok],
        sum(r.prompt_tokens for r in ok),
        sum(r.cached_tokens for r in ok),
        sum(len(r.output_ids) for r in ok),
        duration_s,
        len(results),
        len(results) - len(ok),
    )
    verifies = sum(r.spec_verifies for r in ok)
    out["per_request"] = per_request(results)
    out["spec_verifies"] = verifies
    out["accept_length"] = (verifies + sum(r.spec_correct_drafts for r in ok)) / verifies if verifies else None
    return out


class Progress:
    """One line per finished request: ``[cache] workload  done/total``."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled, self.done = label, total, enabled, 0
        self._lock = threading.Lock()
        self._t0 = time.time()

    def step(self, res: Result) -> None:
        with self._lock:
            self.done += 1
            if self.enabled:
                status = (
                    f"error: {res.error}"
                    if res.error
                    else (f"prompt {res.prompt_tokens} cached {res.cached_tokens} ttft {res.ttft_s:.2f}s")
                )
                print(
                    f"  [{self.label}] {self.done}/{self.total} {res.key}: {status} ({time.time() - self._t0:.0f}s)",
                    flush=True,
                )
