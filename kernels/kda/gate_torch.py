"""KDA gate activation and the q/k L2 norm, as upstream's kernels compute them (fp32)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# The softplus threshold upstream uses (``x < 20 ? log(1 + exp(x)) : x``).
SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """Per-channel log-space decay from the raw gate projection.

    ``g_raw``: ``[..., H, K]``; ``A_log``: ``H`` elements (any shape); ``dt_bias``: ``H*K`` elements.
    Standard gate: ``-exp(A_log) * softplus(g_raw + dt_bias)``.
    Safe gate (``lower_bound`` set): ``lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))``.
    Returns fp32, same shape as ``g_raw``.
    """
    H, K = g_raw.shape[-2], g_raw.shape[-1]
    x = g_raw.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    a = A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return float(lower_bound) * torch.sigmoid(a * x)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` in fp32 (upstream's ``l2norm_fwd``)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
