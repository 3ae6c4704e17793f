"""Which KDA layer's extend is running, for the kernel-level export hook (set by the backend hook)."""

from __future__ import annotations

import contextvars
from typing import NamedTuple, Optional

import torch

from sglang_k3.state.export_stash import ExportStash


class CurrentExtend(NamedTuple):
    layer_id: int  # the model's layer id of the KDA layer running
    mixed_qkv: torch.Tensor  # its raw pre-conv rows
    stash: ExportStash  # where the kernel hook hands the layer's chunk-boundary states


CURRENT_EXTEND: contextvars.ContextVar[Optional[CurrentExtend]] = contextvars.ContextVar(
    "sglang_k3_current_extend", default=None
)
