"""Speculative decoding on CPU: ``fill_front_out_cache_loc_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.fill_front_out_cache_loc`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.cache_locs.fill_front_out_cache_loc_func"
REASON = "moving accepted draft KV packs the verify window's front with a Triton kernel"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.fill_front_out_cache_loc)
