"""One byte buffer for MLA KV, active KDA states and checkpoints: the tensors over it.

The buffer is ``[num_blocks, block_bytes]`` uint8 (one device buffer on a GPU, one host buffer on
CPU), cut by :func:`sglang_k3.cache.block_ledger.plan_geometry`; which block belongs to which kind
is the ledger's business (:class:`~sglang_k3.cache.block_ledger.BlockLedger`). Here each kind
gets plain strided views that span the whole buffer, so SGLang's code and ours index them as if
each kind had the buffer to itself:

* **MLA KV** (token-major): token ``t`` holds every MLA layer's row at byte ``t * kv_token_bytes``;
  layer ``l``'s buffer is ``[num_blocks * kv_per_block, 1, dim]`` with token stride
  ``num_mla_layers * dim``, the shape SGLang's ``MLATokenToKVPool.kv_buffer[l]`` has.
* **Active states** (slot-major): slot ``s`` is blocks ``[s * span, (s + 1) * span)``;
  ``temporal`` is ``[L, num_slots, H, V, K]`` and ``conv`` ``[L, num_slots, *conv]`` with slot
  stride ``span * block_bytes``, the shapes of SGLang's ``MambaPool.mamba_cache``.
* **Checkpoints**: handle ``h`` is sub-slot ``h % m`` of block ``h // m`` at byte
  ``h * ckpt_stride``; ``q``, ``scale`` and ``conv`` are ``[num_blocks * m, ...]``, the shapes
  :class:`~sglang_k3.state.checkpoint_pool.CheckpointPool` keeps.

Nothing is copied between kinds: a block changes kind only when it is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_k3.cache.block_ledger import BlockGeometry

_ALIGN = 64


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class StateLayout:
    """Per-slot layout of one active state: every KDA layer's recurrent and conv state."""

    temporal: tuple  # (L, H, V, K)
    temporal_dtype: torch.dtype
    conv: Optional[tuple]  # (L, *conv_shape)
    conv_dtype: torch.dtype

    @property
    def conv_offset(self) -> int:
        return _round(_nbytes(self.temporal, self.temporal_dtype))

    @property
    def nbytes(self) -> int:
        if self.conv is None:
            return _nbytes(self.temporal, self.temporal_dtype)
        return self.conv_offset + _nbytes(self.conv, self.conv_dtype)

    @classmethod
    def of_mamba_cache(cls, cache) -> "StateLayout":
        """From SGLang's ``MambaPool.mamba_cache`` (``temporal [L, S, H, V, K]``, ``conv[0]``)."""
        t = cache.temporal
        convs = list(cache.conv)
        if len(convs) > 1:
            raise ValueError(f"the unified pool holds one conv state per KDA layer; got {len(convs)}")
        c = convs[0] if convs else None
        return cls(
            temporal=(t.shape[0], *t.shape[2:]),
            temporal_dtype=t.dtype,
            conv=None if c is None else (c.shape[0], *c.shape[2:]),
            conv_dtype=torch.float32 if c is None else c.dtype,
        )


@dataclass(frozen=True)
class CheckpointLayout:
    """Per-slot layout of one checkpoint (see ``CheckpointPool``): values, int8 scales, conv."""

    q: tuple  # (L, H, V, K)
    q_dtype: torch.dtype
    scale: Optional[tuple]  # (L, H, K) fp32, int8 only
    conv: Optional[tuple]  # (L, conv_numel)
    conv_dtype: torch.dtype

    def _offsets(self) -> tuple[int, int, int]:
        q = _round(_nbytes(self.q, self.q_dtype))
        s = q + (_round(_nbytes(self.scale, torch.float32)) if self.scale is not None else 0)
        end = s + (_nbytes(self.conv, self.conv_dtype) if self.conv is not None else 0)
        return q, s, end

    @property
    def nbytes(self) -> int:
        return self._offsets()[2]

    @classmethod
    def of_state(cls, state: StateLayout, dtype: torch.dtype) -> "CheckpointLayout":
        L, H, V, K = state.temporal
        return cls(
            q=(L, H, V, K),
            q_dtype=dtype,
            scale=(L, H, K) if dtype == torch.int8 else None,
            conv=None if state.conv is None else (L, _numel(state.conv[1:])),
            conv_dtype=state.conv_dtype,
        )


class UnifiedBuffer:
    def __init__(self, geom: BlockGeometry, device="cpu"):
        self.geom = geom
        self.device = torch.device(device)
        self.raw = torch.zeros(geom.num_blocks * geom.block_bytes, dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def _strided(self, dtype: torch.dtype, shape: Sequence[int], stride: int, offset: int, count: int) -> torch.Tensor:
        """``count`` entries of ``shape`` (contiguous each), ``stride`` bytes apart from ``offset``."""
        es = torch.empty((), dtype=dtype).element_size()
        if stride % es or offset % es:
            raise ValueError(f"{dtype} view at byte offset {offset}, stride {stride} is misaligned")
        flat = self.raw.view(dtype)
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * int(shape[i + 1])
        return flat.as_strided((count, *shape), (stride // es, *inner), offset // es)

    def kv_layer_views(self, num_layers: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per MLA layer, ``[num_tokens, 1, dim]`` over the whole buffer (token-major)."""
        g = self.geom
        if _nbytes((num_layers, dim), dtype) != g.kv_token_bytes:
            raise ValueError(f"KV rows of {num_layers} x {dim} {dtype} are not {g.kv_token_bytes} bytes per token")
        tokens = g.num_blocks * g.kv_per_block
        row = _nbytes((dim,), dtype)
        return [self._strided(dtype, (1, dim), g.kv_token_bytes, l * row, tokens) for l in range(num_layers)]

    def state_views(self, layout: StateLayout) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``temporal [L, num_slots, H, V, K]`` and ``conv [L, num_slots, *conv]``; slot ``s`` spans
        blocks ``[s * span, (s + 1) * span)``."""
        g = self.geom
        stride = g.active_span * g.block_bytes
        if layout.nbytes > stride:
            raise ValueError(
                f"a state of {layout.nbytes} bytes does not fit {g.active_span} blocks of {g.block_bytes} B"
            )
        t = self._strided(layout.temporal_dtype, layout.temporal, stride, 0, g.num_slots).transpose(0, 1)
        if layout.conv is None:
            return t, None
        c = self._strided(layout.conv_dtype, layout.conv, stride, layout.conv_offset, g.num_slots)
        return t, c.transpose(0, 1)

    def checkpoint_views(self, layout: CheckpointLayout):
        """``q [n, L, H, V, K]``, ``scale [n, L, H, K]`` (or None), ``conv [n, L, numel]`` (or
        None), with ``n = num_blocks * ckpt_per_block`` handles ``ckpt_stride`` bytes apart."""
        g = self.geom
        if layout.nbytes > g.ckpt_stride:
            raise ValueError(f"a checkpoint of {layout.nbytes} bytes does not fit a {g.ckpt_stride}-byte stride")
        n = g.num_blocks * g.ckpt_per_block
        q_end, s_end, _ = layout._offsets()
        q = self._strided(layout.q_dtype, layout.q, g.ckpt_stride, 0, n)
        scale = None if layout.scale is None else self._strided(torch.float32, layout.scale, g.ckpt_stride, q_end, n)
        conv = None if layout.conv is None else self._strided(layout.conv_dtype, layout.conv, g.ckpt_stride, s_end, n)
        return q, scale, conv
