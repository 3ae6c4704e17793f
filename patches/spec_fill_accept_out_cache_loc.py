"""Speculative decoding on CPU: ``fill_accept_out_cache_loc_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.fill_accept_out_cache_loc`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_func"
REASON = "moving accepted draft KV gathers the accepted locations with a Triton kernel"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.fill_accept_out_cache_loc)
