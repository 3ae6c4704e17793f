"""Which KDA layer's extend is running, for the kernel-level export hook (set by the backend hook)."""
from __future__ import annotations

import contextvars
from typing import Optional

import torch

# (model layer id, raw pre-conv mixed_qkv rows) of the KDA extend in progress, else None.
CURRENT_EXTEND: contextvars.ContextVar[Optional[tuple[int, torch.Tensor]]] = contextvars.ContextVar(
    "sglang_k3_current_extend", default=None
)
