"""The k3 cache's configuration: one object, parsed from ``--k3-*`` flags by ``launch_server`` and
read back by every SGLang process and by the trace replay.

It sits below every layer (no imports from the package, no torch) so that the tree layer's
lifecycle (:mod:`sglang_k3.cache.lifecycle`), the server's cache and the replay all build what
they build from the same object. How it travels: SGLang starts the scheduler in a spawned process
from ``ServerArgs``, which has no room for extension flags, so ``launch_server`` publishes the
config in the environment variable ``SGLANG_K3_CONFIG`` (JSON), which child processes inherit;
:func:`from_env` reads it back (defaults when unset, e.g. under ``sglang.launch_server``).
"""

from __future__ import annotations

import dataclasses
import json
import os

ENV_CONFIG = "SGLANG_K3_CONFIG"
CHECKPOINT_DTYPES = ("int8", "bf16", "fp32")
TIER_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


@dataclasses.dataclass(frozen=True)
class K3Config:
    embedded_model_dir: str | None = None
    cpu_defaults: bool = True
    checkpoint_chunk_end: bool = True
    checkpoint_prompt_end: bool = True
    checkpoint_generation_end: bool = True
    checkpoint_branch_points: bool = True
    checkpoint_keep_superseded: bool = False  # keep a finished request's earlier states too
    adaptive_retention: bool = True  # keep states those rules would drop where ghosts show reuse
    lazy_drops: bool = True  # unified memory: those rules' drops wait until memory is short
    checkpoint_budget: int = 8  # checkpoints on one root-to-leaf path; 0: no cap
    checkpoint_dtype: str = "int8"
    checkpoint_slots: int = 64  # int8/bf16: the checkpoint pool's size, in checkpoints
    decode_checkpoint_interval: int = 4096  # tokens; 0: off
    unified_memory: bool = True  # one budget for MLA KV, active states and checkpoints
    min_kv_tokens: int = 0  # unified: checkpoints never take memory KV needs for this many tokens
    min_checkpoints: int = 0  # unified: KV and state pressure never evict checkpoints below this
    max_checkpoints: int = 0  # unified: at most this many checkpoints (0: no cap)
    eviction_alpha: float = 1.0  # weight of FLOPs saved per byte against recency in eviction
    host_tier_gib: float = 0.0  # host tier for evicted boundaries (KV + state), GiB; 0: off
    tier_write_policy: str = "write_back"  # when a boundary is copied down (SGLang's HiCache names)
    mooncake: bool = False  # an L3 tier in a Mooncake store, configured by SGLang's MOONCAKE_* variables
    # tokens: with a lower tier, also save a prompt's state every N tokens straight below; 0 off
    tier_park_interval: int = 4096
    # MiB of tier writes in flight in the writer thread (a save beyond it is dropped); 0: each
    # save writes before it returns, on the scheduler's thread
    tier_write_queue_mib: int = 256
    # Admission budgets per prompt-length class (sglang_k3/fleet/admission.py); no thresholds: off
    admission_thresholds: tuple = ()
    admission_shares: tuple = ()  # per class; empty: 1.0 for the shortest class, 0.5 for each other
    admission_capacity_tokens: int = 0  # 0: the server's --chunked-prefill-size (or --max-prefill-tokens)

    def __post_init__(self) -> None:
        # JSON (to_env/from_env) gives lists; keep the frozen config hashable and comparable.
        object.__setattr__(self, "admission_thresholds", tuple(int(x) for x in self.admission_thresholds))
        object.__setattr__(self, "admission_shares", tuple(float(x) for x in self.admission_shares))
        if self.admission_shares and not self.admission_thresholds:
            raise ValueError("admission shares were given without admission thresholds")
        if self.admission_capacity_tokens < 0:
            raise ValueError(f"admission_capacity_tokens must be >= 0 (got {self.admission_capacity_tokens})")
        # The thresholds and shares themselves are checked where the budgets are built
        # (sglang_k3.fleet.admission.policy_from_config; launch_server does it at start).
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(
                f"checkpoint dtype {self.checkpoint_dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}"
            )
        for name in (
            "checkpoint_budget",
            "decode_checkpoint_interval",
            "min_kv_tokens",
            "min_checkpoints",
            "max_checkpoints",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not (self.eviction_alpha >= 0 and self.eviction_alpha < float("inf")):
            raise ValueError(f"eviction_alpha must be a finite number >= 0 (got {self.eviction_alpha})")
        if not (self.host_tier_gib >= 0 and self.host_tier_gib < float("inf")):
            raise ValueError(f"host_tier_gib must be a finite number >= 0 (got {self.host_tier_gib})")
        if self.tier_park_interval < 0 or self.tier_park_interval % 64:
            raise ValueError(f"tier_park_interval must be a multiple of 64 >= 0 (got {self.tier_park_interval})")
        if self.tier_write_queue_mib < 0:
            raise ValueError(f"tier_write_queue_mib must be >= 0 (got {self.tier_write_queue_mib})")
        if self.tier_write_policy not in TIER_WRITE_POLICIES:
            raise ValueError(
                f"tier write policy {self.tier_write_policy!r}: choose one of {', '.join(TIER_WRITE_POLICIES)}"
            )
        if self.checkpoint_slots < 1:
            raise ValueError(f"checkpoint_slots must be >= 1 (got {self.checkpoint_slots})")
        if self.max_checkpoints and self.min_checkpoints > self.max_checkpoints:
            raise ValueError(
                f"min_checkpoints ({self.min_checkpoints}) is above max_checkpoints ({self.max_checkpoints})"
            )

    @property
    def lower_tiers(self) -> bool:
        """A lower tier is on (host memory or Mooncake): evicted boundaries are kept below."""
        return self.host_tier_gib > 0 or self.mooncake

    def to_env(self) -> None:
        os.environ[ENV_CONFIG] = json.dumps(dataclasses.asdict(self))


def from_env() -> K3Config:
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        return K3Config()
    return K3Config(**json.loads(raw))
