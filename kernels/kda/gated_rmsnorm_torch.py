"""Gated RMSNorm in pure torch (the KDA output norm, upstream ``rms_norm_gated``).

    x'  = x + residual                       (if a residual is given)
    y   = x' / sqrt(mean(x'^2) + eps) * weight + bias
    out = y * sigmoid(g)                     (activation "sigmoid")
        = y * g * sigmoid(g)                 (activation "swish" / "silu")

Computed in fp32 over the last dimension; output in ``x.dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch


def rms_norm_gated_torch(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor] = None,
    activation: str = "swish",
    residual: Optional[torch.Tensor] = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
):
    """Same arguments and returns as upstream's ``rms_norm_gated``: ``y`` shaped like ``x``, or
    ``(y, residual_out)`` when ``prenorm`` (``residual_out`` = ``x + residual`` in the residual's
    dtype, fp32 if ``residual_in_fp32``, else ``x``'s)."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"Unsupported activation: {activation}")
    D = x.shape[-1]
    xf = x.float()
    if residual is not None:
        assert residual.shape == x.shape
        xf = xf + residual.float()
    if residual is not None:
        res_dtype = residual.dtype
    elif residual_in_fp32:
        res_dtype = torch.float32
    else:
        res_dtype = x.dtype
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    gf = g.float().reshape(y.shape[:-1] + (D,)) if g.shape != y.shape else g.float()
    if activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    else:
        y = y * gf * torch.sigmoid(gf)
    y = y.to(x.dtype)
    if prenorm:
        return y, xf.to(res_dtype)
    return y
