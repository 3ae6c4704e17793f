"""Building the k3 cache's lower tiers from its config (``--k3-host-tier-gib``,
``--k3-tier-write-policy``) and the server's pools: the namespace of every object key (model,
tokenizer, layouts, TP rank), the stores, and the pool IO (:mod:`sglang_k3.tiers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_k3.config import K3Config
from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.keys import Namespace, model_fingerprint, tokenizer_fingerprint
from sglang_k3.tiers.manager import TierManager
from sglang_k3.tiers.torch_io import PoolTierIO


@dataclass(frozen=True)
class TierContext:
    """What the server knows that the tier keys need."""

    model_path: str
    tokenizer_path: str
    tp_rank: int = 0
    tp_size: int = 1


def build_tiers(cfg: K3Config, ctx: Optional[TierContext], mla_pool, store) -> Optional[TierManager]:
    """The tier manager for ``cfg``, or None when no lower tier is on."""
    if cfg.host_tier_gib <= 0:
        return None
    pool = getattr(store, "pool", None)
    if pool is None or not hasattr(pool, "slot_parts"):
        raise ValueError(
            "--k3-host-tier-gib needs checkpoints in a checkpoint pool: unified memory (the default) "
            "or --k3-checkpoint-dtype int8/bf16"
        )
    if mla_pool is None:
        raise ValueError("--k3-host-tier-gib needs an MLA KV pool (a Kimi-Linear-style model)")
    if ctx is None:
        raise ValueError("--k3-host-tier-gib needs the model and tokenizer paths for its object keys")
    io = PoolTierIO(mla_pool.kv_buffer, pool)
    ns = Namespace(
        model=model_fingerprint(ctx.model_path),
        tokenizer=tokenizer_fingerprint(ctx.tokenizer_path),
        layout=io.layout,
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
    )
    stores = [HostStore(int(cfg.host_tier_gib * (1 << 30)))]
    return TierManager(stores, ns, io, cfg.tier_write_policy)
