"""Radix-cache backends registered with SGLang's ``register_radix_cache_backend``.

- ``upstream``: exactly what SGLang builds when no backend is named (its default selection
  chain: for hybrid KDA models, ``UnifiedRadixCache`` with FULL + MAMBA components). It exists so
  the baseline can be selected by name and compared side by side with ``k3``.
- ``k3``: sglang-k3's KDA-aware cache (:mod:`sglang_k3.integration.k3_cache`) for hybrid KDA
  models. For a model without KDA/mamba state, or with ``--disable-radix-cache``, it builds what
  ``upstream`` builds: there is no state to be aware of, or nothing to cache.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.registry import (
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

UPSTREAM = "upstream"
K3 = "k3"

logger = logging.getLogger(__name__)


def k3_factory(ctx):
    if ctx.disable_radix_cache or not ctx.is_hybrid_ssm:
        logger.info("k3 radix cache not used (disabled or no KDA state); building upstream's")
        return default_radix_cache_factory(ctx)
    if getattr(ctx.server_args, "mamba_radix_cache_strategy", None) == "extra_buffer":
        # k3 takes its states itself; extra_buffer's per-request ping-pong slots would stay
        # allocated after every request (sglang_k3.launch_server adds no_buffer for k3)
        raise ValueError(
            "--radix-cache-backend k3 needs --mamba-radix-cache-strategy no_buffer, but SGLang resolved "
            f"{ctx.server_args.mamba_radix_cache_strategy!r}. Start it with python -m sglang_k3.launch_server "
            "(which adds no_buffer) or pass --mamba-radix-cache-strategy no_buffer; "
            "--radix-cache-backend upstream is SGLang's own extra_buffer cache."
        )
    from sglang_k3.integration.k3_args import check_speculative, current
    from sglang_k3.integration.platform_entry import cpu_platform_wanted

    sa = ctx.server_args
    check_speculative(
        getattr(sa, "speculative_algorithm", None),
        cpu=cpu_platform_wanted(),
        ngram_breadth=getattr(sa, "speculative_ngram_max_bfs_breadth", None),
        eagle_topk=getattr(sa, "speculative_eagle_topk", None),
        eagle_steps=getattr(sa, "speculative_num_steps", None),
        eagle_draft_tokens=getattr(sa, "speculative_num_draft_tokens", None),
    )
    from sglang_k3.integration.k3_cache import K3RadixCache
    from sglang_k3.integration.tier_setup import TierContext

    hf = getattr(ctx.model_config, "hf_config", None)
    tier_ctx = TierContext(
        model_path=sa.model_path,
        tokenizer_path=sa.tokenizer_path or sa.model_path,
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
    )
    return K3RadixCache(ctx.params, current(), hf_config=hf.to_dict() if hf is not None else None, tier_ctx=tier_ctx)


def register() -> None:
    if get_radix_cache_factory(UPSTREAM) is None:
        register_radix_cache_backend(UPSTREAM, default_radix_cache_factory)
    if get_radix_cache_factory(K3) is None:
        register_radix_cache_backend(K3, k3_factory)
