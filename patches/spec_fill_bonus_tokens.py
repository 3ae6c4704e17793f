"""Speculative decoding on CPU: ``fill_bonus_tokens_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.fill_bonus_tokens`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_func"
REASON = "an EAGLE verify picks each request's last accepted token with a Triton kernel"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.fill_bonus_tokens)
