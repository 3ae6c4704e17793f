"""Radix-cache backends registered with SGLang's ``register_radix_cache_backend``.

- ``upstream``: exactly what SGLang builds when no backend is named (its default selection
  chain: for hybrid KDA models, ``UnifiedRadixCache`` with FULL + MAMBA components). It exists so
  the baseline can be selected by name and compared side by side with ``k3``.
"""
from __future__ import annotations

from sglang.srt.mem_cache.registry import (
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

UPSTREAM = "upstream"


def register() -> None:
    if get_radix_cache_factory(UPSTREAM) is None:
        register_radix_cache_backend(UPSTREAM, default_radix_cache_factory)
