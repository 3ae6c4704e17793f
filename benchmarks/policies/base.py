"""The driver every policy shares: it runs the real ``sglang_k3.cache.K3RadixTree`` in simulated time.

A policy answers two events of one request (``admit`` at prefill start, ``finish`` when its last
token is generated) by calling the tree's public API the way a serving integration would:
``find_branch_point`` / ``match_prefix(pin=True)`` -> ``insert`` -> ``add_checkpoint`` ->
``commit_step`` -> ``release_pin`` -> ``recycle_path`` -> ``evict``, and ``inc_lock_ref`` /
``dec_lock_ref`` around the request's lifetime. There is no second copy of the cache logic here:
what differs between policies is only *where* checkpoints are placed (a plan of positions), how far
KV is inserted, the eviction weights, the page/hit unit and how the byte budget is split.

Units: the tree works on symbols (``cfg.unit`` real tokens each, see ``benchmarks.trace``).
Positions in plans are symbols; bytes are real bytes (KV bytes per symbol = unit x per-token bytes).

Memory: the budget covers what the tree holds, MLA KV of cached tokens plus checkpoints. A running
request's KV is inserted at prefill end and locked, so it counts too; its private active KDA slot
and not-yet-inserted decode KV do not (the same for every policy). Two pool layouts:
``unified`` (one byte budget, k3's design) and ``split`` (a fixed KV share and state share, as
upstream's static pools). Over budget, the driver asks the tree for KV tokens (the tree frees dead
KV tails first, then whole leaves with their checkpoints by its utility order) and, for a separate
state pool, for checkpoint bytes (dropping a checkpoint keeps its KV). What a locked path holds is
never evicted, so the budget can be exceeded while requests run; the peak excess is reported.
Eviction runs when a pool is over its budget and frees down to a low watermark,
``(1 - evict_watermark) x budget`` (default 2 %), for every policy alike: the tree re-ranks all
candidates on each call, and one call per request would not fit the 10-minute limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from sglang_k3.cache import CheckpointKind, EvictionPolicy, K3RadixTree, ModelCostConfig

GiB = 1 << 30


class ScaledCost:
    """A ``ModelCostConfig`` seen in symbols: the tree's eviction asks for FLOPs between symbol
    positions and for KV bytes per symbol; this answers in real FLOPs and bytes."""

    def __init__(self, cost: ModelCostConfig, unit: int) -> None:
        self.cost, self.unit = cost, unit
        # prefill_flops(a, b) = n * lin + att * (a + b + 1) * n / 2 with n = b - a (cost_model.py);
        # read both coefficients off the model once instead of rebuilding them on every call
        f1, f2 = cost.prefill_flops(0, 1), cost.prefill_flops(0, 2)
        self._att = f2 - 2 * f1
        self._lin = f1 - self._att
        assert abs(self._flops(1000, 4096) - cost.prefill_flops(1000, 4096)) <= 1e-9 * cost.prefill_flops(1000, 4096)

    def _flops(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        n = b - a
        return n * self._lin + self._att * (a + b + 1) * n / 2

    def prefill_flops(self, a: int, b: int) -> float:
        return self._flops(a * self.unit, b * self.unit)

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        return self.cost.kv_bytes_per_token(dtype) * self.unit


@dataclass
class SimConfig:
    cost: ModelCostConfig
    unit: int = 64  # real tokens per symbol (the KDA chunk / hit unit)
    checkpoint_dtype: str = "int8"  # k3, marconi
    baseline_state_dtype: str = "fp32"  # upstream, vllm-align (what those systems store)
    kv_dtype: str = "bf16"
    chunked_prefill_size: int = 8192  # real tokens
    upstream_mamba_ratio: float = 0.9  # SGLang's mamba_full_memory_ratio fallback
    evict_watermark: float = 0.02  # over budget: evict down to (1 - this) x budget
    host_budget_bytes: float = 0  # k3 policies: a host tier of this size (0: off), policies/tiers.py
    l3_budget_bytes: float = 0  # k3 policies: a Mooncake (L3) tier of this size (0: off)
    host_gbps: float = 55.0  # host -> device, GB/s (H200, pinned, benchmarks/GPU_NOTES.md)
    l3_gbps: float = 12.5  # L3 -> device, GB/s (one 100 Gb/s RDMA NIC: an assumption)
    tier_park_interval: Optional[int] = None  # k3 with a tier: --k3-tier-park-interval (tokens); None: its default

    @property
    def kv_bytes_per_symbol(self) -> int:
        return self.cost.kv_bytes_per_token(self.kv_dtype) * self.unit

    def checkpoint_bytes(self, dtype: str) -> int:
        return self.cost.checkpoint_bytes(dtype)

    def chunk_ends(self, restore: int, prompt_sym: int) -> list[int]:
        """Absolute ends (symbols) of the prefill chunks from ``restore`` to the prompt end."""
        c = max(1, self.chunked_prefill_size // self.unit)
        ends = list(range(restore + c, prompt_sym, c))
        ends.append(prompt_sym)
        return ends


@dataclass
class Admission:
    hit_tokens: int  # real tokens reused (restore boundary x unit)
    mla_tokens: int = 0  # real tokens whose KV was present (phase-1 match)
    ctx: object = None
    load_s: float = 0.0  # time to bring the hit up from a lower tier (added to the prefill)


@dataclass
class _Ctx:
    node: object  # the locked node (None: nothing locked)
    prompt_track: int = 0  # symbols: deepest state this request registered at prefill
    backup: object = None  # what backed_up returned at admission (a host tier's locked node)


class Policy:
    """Interface the replay loop drives."""

    name = "?"
    budget_independent = False

    def admit(self, trace, i: int) -> Admission:
        raise NotImplementedError

    def finish(self, trace, i: int, ctx) -> None:
        raise NotImplementedError

    def sample(self) -> tuple[int, int]:
        """(KV bytes, checkpoint bytes) held now."""
        raise NotImplementedError

    def summary(self) -> dict:
        return {}


@dataclass
class TreePolicy(Policy):
    """Drives one K3RadixTree. Subclasses override the ``plan_*`` hooks."""

    cfg: SimConfig
    budget_bytes: Optional[float]  # None: unlimited
    page: int = 1  # symbols
    hit_unit: int = 1  # symbols
    eviction: Optional[EvictionPolicy] = None
    state_dtype: Optional[str] = None  # None: no checkpoints (KV-only prefix cache)
    ckpt_nbytes: int = 0
    pool: str = "unified"  # or "split"
    state_share: float = 0.0  # split: fraction of the budget for states
    state_pool_bytes: Optional[float] = None  # split: the tree's states get this pool instead (KV keeps its share)
    insert_to_last_checkpoint: bool = False  # upstream keys its inserts at the tracked state
    overshoot_max: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.tree = K3RadixTree(
            num_groups=1,
            page_size=self.page,
            hit_unit=self.hit_unit,
            eviction=self.eviction or EvictionPolicy(cost=ScaledCost(self.cfg.cost, self.cfg.unit)),
        )
        if self.state_dtype is not None and not self.ckpt_nbytes:
            self.ckpt_nbytes = self.cfg.checkpoint_bytes(self.state_dtype)
        self._kv_next = 0
        self._h_next = 0
        self.ckpt_placed = 0

    # ------------------------------------------------------------------ hooks
    def branch_point(self, key: list) -> Optional[int]:
        return None

    def plan_prefill(
        self, prompt_sym: int, key_len: int, restore: int, mla_len: int, branch: Optional[int]
    ) -> dict[int, CheckpointKind]:
        return {}

    def plan_finish(self, L: int, O: int, ctx: _Ctx) -> dict[int, CheckpointKind]:
        return {}

    def after_insert(self, node) -> None:
        """E.g. recycle superseded checkpoints on the request's path."""

    def hit_of(self, m, key_len: int) -> int:
        """Symbols reused for a match (hybrid: the restore boundary)."""
        return m.restore_len

    def lower_tier_hit(self, key: list, m, restore: int) -> tuple[int, int, dict[int, CheckpointKind], float]:
        """A tier below the device: ``(restore, KV-hit length, states the load places on the device,
        load seconds)`` for a device match ``m`` that restores ``restore``. None below: the device's."""
        return restore, m.mla_len, {}, 0.0

    def backed_up(self, seq: list, end: int, plan: dict[int, CheckpointKind], running: bool) -> object:
        """After the device tree took ``seq[:end]`` and ``plan``'s states (``running``: at admission,
        the request still runs): a tier below may copy them. Returns what ``release_backup`` gets."""
        return None

    def release_backup(self, backup: object) -> None:
        """The request that ``backed_up`` ran for finished."""

    # ------------------------------------------------------------------ helpers
    def _kv(self, n: int) -> range:
        r = range(self._kv_next, self._kv_next + n)
        self._kv_next += n
        return r

    def _place(self, node, plan: dict[int, CheckpointKind]) -> None:
        for pos in sorted(plan):
            if pos <= 0 or pos > node.end:
                continue
            self._h_next += 1
            if self.tree.add_checkpoint(node, pos, [self._h_next], self.ckpt_nbytes, kind=plan[pos]) is not None:
                self.ckpt_placed += 1
        self.tree.commit_step()  # the prefill's/decode's state copies have landed

    def kv_bytes(self) -> int:
        return self.tree.total_size() * self.cfg.kv_bytes_per_symbol

    def sample(self) -> tuple[int, int]:
        return self.kv_bytes(), self.tree.checkpoint_bytes()

    def enforce_budget(self) -> None:
        if self.budget_bytes is None:
            return
        kvb = self.cfg.kv_bytes_per_symbol
        low = 1.0 - self.cfg.evict_watermark
        if self.pool == "split":
            kv_budget = self.budget_bytes * (1.0 - self.state_share)
            state_budget = self.budget_bytes - kv_budget if self.state_pool_bytes is None else self.state_pool_bytes
            if self.tree.checkpoint_bytes() > state_budget:
                self.tree.evict(num_bytes=math.ceil(self.tree.checkpoint_bytes() - state_budget * low))
            if self.kv_bytes() > kv_budget:
                self.tree.evict(num_tokens=math.ceil((self.kv_bytes() - kv_budget * low) / kvb))
            excess = max(0.0, self.tree.checkpoint_bytes() - state_budget) + max(0.0, self.kv_bytes() - kv_budget)
        else:
            if self.kv_bytes() + self.tree.checkpoint_bytes() > self.budget_bytes:
                while True:
                    over = self.kv_bytes() + self.tree.checkpoint_bytes() - self.budget_bytes * low
                    if over <= 0:
                        break
                    freed = self.tree.evict(num_tokens=math.ceil(over / kvb))
                    if not freed.kv_indices and not freed.checkpoint_bytes:
                        break
            excess = max(0.0, self.kv_bytes() + self.tree.checkpoint_bytes() - self.budget_bytes)
        self.overshoot_max = max(self.overshoot_max, excess)

    # ------------------------------------------------------------------ events
    def admit(self, trace, i: int) -> Admission:
        key = trace.prompt(i)
        L, u = trace.input_len[i], self.cfg.unit
        branch = self.branch_point(key)
        m = self.tree.match_prefix(key, pin=True)  # invariant 1: pinned before anything is allocated
        restore, mla, loaded, load_s = self.lower_tier_hit(key, m, self.hit_of(m, len(key)))
        plan = {**loaded, **self.plan_prefill(L // u, len(key), restore, mla, branch)}
        end = len(key)
        if self.insert_to_last_checkpoint:
            end = max(plan) if plan else 0
        node = None
        if end > 0:
            res = self.tree.insert(key[:end], self._kv(end))
            node = res.node
            if node is self.tree.root:
                node = None
        if node is not None:
            self.tree.inc_lock_ref(node)  # the running request holds its path
            self._place(node, plan)
        if m.pin is not None:
            self.tree.release_pin(m.pin)  # the COW out of the checkpoint has landed
        if node is not None:
            self.after_insert(node)
        self.enforce_budget()
        return Admission(
            hit_tokens=restore * u,
            mla_tokens=min(mla, len(key) - 1) * u,
            ctx=_Ctx(node=node, prompt_track=max(plan) if plan else 0, backup=self.backed_up(key, end, plan, True)),
            load_s=load_s,
        )

    def finish(self, trace, i: int, ctx: _Ctx) -> None:
        L, O = trace.input_len[i], trace.output_len[i]
        seq = trace.full(i)
        plan = self.plan_finish(L, O, ctx)
        end = len(seq)
        if self.insert_to_last_checkpoint:
            end = max(plan) if plan else ctx.prompt_track
        if end > 0:
            res = self.tree.insert(seq[:end], self._kv(end))
            if res.node is not self.tree.root:
                self._place(res.node, plan)
        if ctx.node is not None:
            self.tree.dec_lock_ref(ctx.node)
        if end > 0 and res.node is not self.tree.root and res.node.parent is not None:
            self.after_insert(res.node)
        self.enforce_budget()
        self.release_backup(ctx.backup)
        self.backed_up(seq, end, plan, False)

    def summary(self) -> dict:
        s = self.tree.stats
        return {
            "checkpoints_placed": self.ckpt_placed,
            "checkpoints_evicted": s.evicted_checkpoints,
            "checkpoints_recycled": s.recycled_checkpoints,
            "kv_tokens_evicted": s.evicted_kv_tokens * self.cfg.unit,
            "state_bytes_per_checkpoint": self.ckpt_nbytes,
            "budget_overshoot_bytes_max": self.overshoot_max,
            # prompt tokens not restored, by cause (sglang_k3/cache/ghosts.py), in real tokens
            "misses": {k: v * self.cfg.unit for k, v in self.tree.misses.as_dict().items()},
        }
