"""Speculative decoding on CPU: ``assign_draft_cache_locs_contiguous_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.assign_draft_cache_locs_contiguous`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_func"
REASON = "an EAGLE draft step gathers its KV locations with a Triton kernel"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.assign_draft_cache_locs_contiguous)
