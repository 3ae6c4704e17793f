"""Counters the tree keeps for observability (the integration exports them to Prometheus and
/server_info; the simulator prints them). Pure data, updated by the tree."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MatchRecord:
    """One lookup: requested length, MLA hit, restore boundary and replayed tokens."""

    key_len: int
    mla_len: int
    restore_len: int
    replayed_tokens: int


@dataclass
class CacheStats:
    lookups: int = 0
    requested_tokens: int = 0  # sum of key lengths looked up
    hit_tokens: int = 0  # sum of restore_len (tokens actually reused)
    mla_hit_tokens: int = 0  # sum of mla_len (tokens with KV present)
    replayed_tokens: int = 0
    checkpoints: int = 0  # live checkpoints
    checkpoint_bytes: int = 0  # live checkpoint bytes
    evicted_kv_tokens: int = 0
    evicted_checkpoints: int = 0
    evicted_checkpoint_bytes: int = 0
    recycled_checkpoints: int = 0
    waiting_refreshes: int = 0  # runs of touch(): refreshes of the waiting queue's prefixes
    evicted_wanted_checkpoints: int = 0  # of evicted_checkpoints, ones a waiting request wanted
    deferred_checkpoints: int = 0  # states a placement rule let go while memory was free, kept until short
    deferred_hits: int = 0  # hits on such states (each one a prefill the rule would have recomputed)
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))

    @property
    def token_hit_rate(self) -> float:
        """Reused tokens over looked-up tokens (the restore boundary, not the MLA match)."""
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    def record_match(self, rec: MatchRecord) -> None:
        self.lookups += 1
        self.requested_tokens += rec.key_len
        self.hit_tokens += rec.restore_len
        self.mla_hit_tokens += rec.mla_len
        self.replayed_tokens += rec.replayed_tokens
        self.recent.append(rec)

    def as_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "recent"}
        d["token_hit_rate"] = self.token_hit_rate
        return d
