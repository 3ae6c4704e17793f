"""Admission budgets per request class: a burst of long prompts takes at most its class's share of
an instance's prefill capacity, so short requests behind it are not starved (the K3 report, seeds
``002_a9b018a8b5a799d4.txt``, section 7: each request class gets its own budget, and a burst of
long-context traffic can eat only its own share).

A request's class is set by its prompt length against ascending ``thresholds``: class 0 holds
prompts shorter than ``thresholds[0]``, class ``i`` those in ``[thresholds[i-1], thresholds[i])``,
the last class everything from ``thresholds[-1]`` up. Class ``i`` may hold at most
``shares[i] * capacity_tokens`` prompt tokens in flight on this instance. A request holds its
prompt length from admission until its prefill is done: the scheduler's first output for it (with
``stream`` that is the first token; without, SGLang sends nothing before the request finishes, so
then it holds until it finishes), or until it fails or is aborted.

Rules:

- A request is admitted when its class's tokens in flight plus its own fit the class budget, and
  no earlier request of its class is waiting (first come, first served within a class; classes do
  not wait for each other).
- A request larger than its class's whole budget is admitted when its class has nothing in flight,
  so it runs alone instead of never.

Prompt length is the whole prompt, cached or not: the cache's hit is known only once the scheduler
matches the prompt, after admission.

Torch-free and single-threaded: every call runs on one asyncio loop (SGLang's tokenizer manager's).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import time
from collections import deque
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    thresholds: tuple[int, ...]  # ascending prompt lengths separating the classes
    shares: tuple[float, ...]  # per class, of capacity_tokens; one more than thresholds
    capacity_tokens: int  # the instance's prefill capacity, in prompt tokens in flight

    def __post_init__(self) -> None:
        t, s = tuple(self.thresholds), tuple(self.shares)
        if not t:
            raise ValueError("admission budgets need at least one threshold (two classes)")
        if any(x <= 0 for x in t) or any(b <= a for a, b in zip(t, t[1:])):
            raise ValueError(f"admission thresholds must be positive and ascending (got {list(t)})")
        if len(s) != len(t) + 1:
            raise ValueError(
                f"admission shares: {len(t)} thresholds make {len(t) + 1} classes, got {len(s)} shares ({list(s)})"
            )
        if any(not (0 < x <= 1) for x in s):
            raise ValueError(f"admission shares must be in (0, 1] (got {list(s)})")
        if self.capacity_tokens < 1:
            raise ValueError(f"admission capacity must be >= 1 token (got {self.capacity_tokens})")

    @property
    def n_classes(self) -> int:
        return len(self.thresholds) + 1

    def class_of(self, n_tokens: int) -> int:
        return bisect.bisect_right(self.thresholds, n_tokens)

    def budget(self, cls: int) -> int:
        return max(1, int(self.shares[cls] * self.capacity_tokens))

    def class_name(self, cls: int) -> str:
        lo = 0 if cls == 0 else self.thresholds[cls - 1]
        return (
            f"<{self.thresholds[0]}"
            if cls == 0
            else (f">={lo}" if cls == len(self.thresholds) else f"{lo}-{self.thresholds[cls] - 1}")
        )


def default_shares(n_thresholds: int) -> tuple[float, ...]:
    """The shortest class may use the whole capacity, every longer class half of it."""
    return (1.0,) + (0.5,) * n_thresholds


def policy_from_config(cfg, server_capacity_tokens: int) -> Optional[AdmissionPolicy]:
    """The budgets a :class:`sglang_k3.config.K3Config` asks for, or None when off (no thresholds).
    ``server_capacity_tokens`` is the capacity when the config gives none. Raises ``ValueError``
    for thresholds or shares that do not make a policy."""
    if not cfg.admission_thresholds:
        return None
    shares = cfg.admission_shares or default_shares(len(cfg.admission_thresholds))
    return AdmissionPolicy(
        tuple(cfg.admission_thresholds), tuple(shares), cfg.admission_capacity_tokens or server_capacity_tokens
    )


@dataclasses.dataclass
class ClassStats:
    budget_tokens: int
    in_flight_tokens: int = 0
    in_flight_requests: int = 0
    peak_in_flight_tokens: int = 0
    waiting: int = 0
    admitted: int = 0
    waited: int = 0  # admitted after waiting for their class's budget
    oversized: int = 0  # larger than the whole budget: admitted alone
    wait_seconds: float = 0.0
    max_wait_seconds: float = 0.0


class _Waiter:
    __slots__ = ("rid", "n", "future", "t0")

    def __init__(self, rid: str, n: int, future: asyncio.Future, t0: float):
        self.rid, self.n, self.future, self.t0 = rid, n, future, t0


class AdmissionControl:
    """The budgets of one instance. ``acquire`` before a request goes to the scheduler,
    ``release`` when its prefill is done (idempotent; unknown ids are ignored)."""

    def __init__(self, policy: AdmissionPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self.classes = [ClassStats(budget_tokens=policy.budget(c)) for c in range(policy.n_classes)]
        self._waiters: list[deque[_Waiter]] = [deque() for _ in range(policy.n_classes)]
        self._held: dict[str, tuple[int, int]] = {}  # rid -> (class, tokens)

    def holds(self, rid: str) -> bool:
        return rid in self._held

    def _fits(self, cls: int, n: int) -> bool:
        st = self.classes[cls]
        return st.in_flight_requests == 0 or st.in_flight_tokens + n <= st.budget_tokens

    def _grant(self, rid: str, cls: int, n: int, waited_s: Optional[float]) -> None:
        st = self.classes[cls]
        if rid in self._held:
            raise ValueError(f"request {rid!r} is already admitted")
        if n > st.budget_tokens:
            st.oversized += 1
        self._held[rid] = (cls, n)
        st.in_flight_tokens += n
        st.in_flight_requests += 1
        st.peak_in_flight_tokens = max(st.peak_in_flight_tokens, st.in_flight_tokens)
        st.admitted += 1
        if waited_s is not None:
            st.waited += 1
            st.wait_seconds += waited_s
            st.max_wait_seconds = max(st.max_wait_seconds, waited_s)

    async def acquire(self, rid: str, n_tokens: int) -> None:
        """Wait until the request's class has room for ``n_tokens``. Cancelled while waiting, it
        leaves the queue and holds nothing."""
        cls = self.policy.class_of(n_tokens)
        q = self._waiters[cls]
        if not q and self._fits(cls, n_tokens):
            self._grant(rid, cls, n_tokens, None)
            return
        w = _Waiter(rid, n_tokens, asyncio.get_running_loop().create_future(), self.clock())
        q.append(w)
        self.classes[cls].waiting += 1
        try:
            await w.future
        except asyncio.CancelledError:
            if w.future.done() and not w.future.cancelled():
                self.release(rid)  # granted in the same step it was cancelled
            elif w in q:
                q.remove(w)
                self.classes[cls].waiting -= 1
                self._wake(cls)  # the head may have been blocking others
            raise

    def release(self, rid: str) -> None:
        held = self._held.pop(rid, None)
        if held is None:
            return
        cls, n = held
        st = self.classes[cls]
        st.in_flight_tokens -= n
        st.in_flight_requests -= 1
        self._wake(cls)

    def _wake(self, cls: int) -> None:
        q, st = self._waiters[cls], self.classes[cls]
        while q and self._fits(cls, q[0].n):
            w = q.popleft()
            st.waiting -= 1
            self._grant(w.rid, cls, w.n, self.clock() - w.t0)
            w.future.set_result(None)

    def stats(self) -> dict:
        p = self.policy
        return {
            "capacity_tokens": p.capacity_tokens,
            "thresholds": list(p.thresholds),
            "classes": [
                {"name": p.class_name(c), "share": p.shares[c], **dataclasses.asdict(st)}
                for c, st in enumerate(self.classes)
            ],
        }
