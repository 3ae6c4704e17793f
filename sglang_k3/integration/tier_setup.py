"""Building the k3 cache's lower tiers from its config (``--k3-host-tier-gib``, ``--k3-mooncake``,
``--k3-tier-write-policy``) and the server's pools: the namespace of every object key (model,
tokenizer, layouts, TP rank), the stores (host first, then Mooncake), and the pool IO
(:mod:`sglang_k3.tiers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_k3.config import K3Config
from sglang_k3.tiers.codec import HEADER_BYTES
from sglang_k3.tiers.host_store import HostStore
from sglang_k3.tiers.keys import BLOCK_TOKENS, Namespace, model_fingerprint, tokenizer_fingerprint
from sglang_k3.tiers.manager import TierManager
from sglang_k3.tiers.torch_io import PoolTierIO, host_buffers_for


@dataclass(frozen=True)
class TierContext:
    """What the server knows that the tier keys need."""

    model_path: str
    tokenizer_path: str
    tp_rank: int = 0
    tp_size: int = 1


def build_tiers(cfg: K3Config, ctx: Optional[TierContext], mla_pool, store) -> Optional[TierManager]:
    """The tier manager for ``cfg``, or None when no lower tier is on."""
    if not cfg.lower_tiers:
        return None
    pool = getattr(store, "pool", None)
    if pool is None or not hasattr(pool, "slot_parts"):
        raise ValueError("lower tiers need checkpoints in a checkpoint pool (make_store(pooled=True) puts them there)")
    if mla_pool is None:
        raise ValueError("lower tiers need an MLA KV pool (a Kimi-Linear-style model)")
    if ctx is None:
        raise ValueError("lower tiers need the model and tokenizer paths for their object keys")
    io = PoolTierIO(mla_pool.kv_buffer, pool)
    ns = Namespace(
        model=model_fingerprint(ctx.model_path),
        tokenizer=tokenizer_fingerprint(ctx.tokenizer_path),
        layout=io.layout,
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
    )
    stores = []
    if cfg.host_tier_gib > 0:
        stores.append(HostStore(int(cfg.host_tier_gib * (1 << 30)), alloc=host_buffers_for(io.device)))
    if cfg.mooncake:
        from sglang_k3.tiers.mooncake_store import MooncakeStore, load_config

        largest = HEADER_BYTES + io.state_bytes + BLOCK_TOKENS * io.kv_token_bytes
        stores.append(MooncakeStore(load_config(), local_buffer_bytes=max(16 << 20, 4 * largest)))
    return TierManager(stores, ns, io, cfg.tier_write_policy, write_queue_bytes=cfg.tier_write_queue_mib << 20)
