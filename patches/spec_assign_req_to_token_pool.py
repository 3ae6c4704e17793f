"""Speculative decoding on CPU: ``assign_req_to_token_pool_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.assign_req_to_token_pool`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
REASON = "spec decode writes each request's new KV locations into req_to_token with a Triton kernel"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.assign_req_to_token_pool)
