"""Checkpoint slots for KDA recurrent + conv states: INT8 (default), bf16 or fp32.

A checkpoint holds the state of every KDA layer of one group at one token boundary. Its life:

    alloc -> (store | store_from_intermediate for every layer) -> sealed (read-only, shareable)
          -> restore(...) any number of times (copy-on-write into private fp32 active slots)
          -> decref -> free

* The active side is upstream's ``MambaPool`` layout: ``temporal [L, S, H, V, K]`` (fp32) and
  ``conv [L, S, *conv_shape]`` (native dtype), i.e. ``mamba_pool.mamba_cache.temporal`` and
  ``.conv[0]``. ``bind_active`` takes them (or a ``MambaPool`` / its ``State``).
* A restored state continues in full precision in its active slot; the checkpoint is never written
  again (a sealed slot refuses ``store``), so nothing is requantized while a request runs.
* fp32 checkpoints are a bit-exact round trip. int8 stores per-(layer, head, k) fp32 scales
  (see ``sglang_k3.kernels.ckpt``). The conv state is kept in its native dtype in all formats.
* A state with a NaN/Inf (or one that would become non-finite when stored) is refused: ``store``
  returns a per-pair ``accepted`` list and releases the refused checkpoint slots.
* On CUDA tensors the Triton kernels run (one launch per call for all layers); elsewhere the
  pure-torch references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Union

import torch

from sglang_k3.kernels import ckpt as K

_DTYPES = {
    "int8": torch.int8,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def parse_checkpoint_dtype(d: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(d, torch.dtype):
        if d not in (torch.int8, torch.bfloat16, torch.float32):
            raise ValueError(f"unsupported checkpoint dtype {d}")
        return d
    try:
        return _DTYPES[d]
    except KeyError:
        raise ValueError(f"unsupported checkpoint dtype {d!r}; choose int8, bf16 or fp32") from None


class CheckpointError(RuntimeError):
    pass


@dataclass
class StoreResult:
    accepted: List[bool]
    rejected_slots: List[int]

    @property
    def all_ok(self) -> bool:
        return all(self.accepted)


class SlotSource(Protocol):
    """Who decides which checkpoint handles are free, when not the pool itself."""

    def alloc(self) -> Optional[int]: ...

    def free(self, handle: int) -> None: ...

    def available(self) -> int: ...


class CheckpointPool:
    """Pool of ``num_slots`` checkpoint slots (ids 0..num_slots-1)."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        num_heads: int,
        head_v_dim: int,
        head_k_dim: int,
        conv_shape: Optional[Sequence[int]] = None,
        conv_dtype: torch.dtype = torch.bfloat16,
        dtype: Union[str, torch.dtype] = "int8",
        device: Union[str, torch.device] = "cpu",
        use_triton: Optional[bool] = None,
        buffers: Optional[tuple] = None,
        slots: Optional["SlotSource"] = None,
    ):
        """``buffers`` (``q``, ``scale``, ``conv`` views, e.g. into the unified buffer) replace the
        pool's own tensors; ``slots`` then decides which handles are free (the unified budget's
        ledger) instead of the pool's own free list."""
        self.dtype = parse_checkpoint_dtype(dtype)
        self.num_slots = int(num_slots)
        self.L, self.H, self.V, self.K = num_layers, num_heads, head_v_dim, head_k_dim
        self.device = torch.device(device)
        self.use_triton = use_triton
        self.conv_shape = tuple(conv_shape) if conv_shape is not None else None
        self.conv_dtype = conv_dtype
        n = self.num_slots
        self._slots = slots
        if buffers is not None:
            self.q, self.scale, self.conv = buffers
            if self.q.shape != (n, self.L, self.H, self.V, self.K) or self.q.dtype != self.dtype:
                raise ValueError(f"checkpoint buffer {tuple(self.q.shape)} {self.q.dtype} does not match the pool")
            if (self.scale is None) != (self.dtype != torch.int8) or (self.conv is None) != (self.conv_shape is None):
                raise ValueError("checkpoint buffers do not match the pool's format")
        else:
            self.q = torch.zeros(n, self.L, self.H, self.V, self.K, dtype=self.dtype, device=self.device)
            self.scale = (
                torch.zeros(n, self.L, self.H, self.K, dtype=torch.float32, device=self.device)
                if self.dtype == torch.int8
                else None
            )
            self.conv = None
            if self.conv_shape is not None:
                numel = 1
                for s in self.conv_shape:
                    numel *= int(s)
                self.conv = torch.zeros(n, self.L, numel, dtype=conv_dtype, device=self.device)
        self._ref = [0] * n
        self._sealed = [False] * n
        self._layers_written: List[set] = [set() for _ in range(n)]
        self._free = [] if slots is not None else list(range(n - 1, -1, -1))
        # persistent per-pair non-finite flags for the CUDA kernels (they only set flags): saves a
        # memset launch per store; re-zeroed only after a refusal
        self._flags = torch.zeros(n, dtype=torch.int32, device=self.device) if self.device.type == "cuda" else None
        self.active_temporal: Optional[torch.Tensor] = None
        self.active_conv: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_active(
        cls,
        temporal: torch.Tensor,
        conv: Optional[torch.Tensor],
        *,
        num_slots: int,
        dtype="int8",
        device=None,
        use_triton=None,
        buffers=None,
        slots: Optional[SlotSource] = None,
    ) -> "CheckpointPool":
        """Size a pool after upstream's active tensors (``temporal [L, S, H, V, K]``,
        ``conv [L, S, *conv_shape]``) and bind them as the active side."""
        L, _, H, V, Kd = temporal.shape
        pool = cls(
            num_slots=num_slots,
            num_layers=L,
            num_heads=H,
            head_v_dim=V,
            head_k_dim=Kd,
            conv_shape=None if conv is None else tuple(conv.shape[2:]),
            conv_dtype=conv.dtype if conv is not None else torch.bfloat16,
            dtype=dtype,
            device=device or temporal.device,
            use_triton=use_triton,
            buffers=buffers,
            slots=slots,
        )
        pool.bind_active(temporal, conv)
        return pool

    @classmethod
    def from_mamba_pool(cls, mamba_pool, *, num_slots: int, dtype="int8", use_triton=None, buffers=None, slots=None):
        """From an upstream ``MambaPool`` (or its ``State``): binds ``temporal`` and ``conv[0]``."""
        state = getattr(mamba_pool, "mamba_cache", mamba_pool)
        convs = list(state.conv)
        if len(convs) > 1:
            raise ValueError("KDA has one conv state tensor per layer; got %d" % len(convs))
        return cls.from_active(
            state.temporal,
            convs[0] if convs else None,
            num_slots=num_slots,
            dtype=dtype,
            use_triton=use_triton,
            buffers=buffers,
            slots=slots,
        )

    def bind_active(self, temporal: torch.Tensor, conv: Optional[torch.Tensor] = None) -> None:
        if tuple(temporal.shape[0:1] + temporal.shape[2:]) != (self.L, self.H, self.V, self.K):
            raise ValueError(
                f"active temporal {tuple(temporal.shape)} does not match "
                f"[L={self.L}, S, H={self.H}, V={self.V}, K={self.K}]"
            )
        if (conv is None) != (self.conv is None):
            raise ValueError("conv state presence differs between the active side and the pool")
        if conv is not None and tuple(conv.shape[2:]) != self.conv_shape:
            raise ValueError(f"active conv {tuple(conv.shape)} vs pool conv shape {self.conv_shape}")
        self.active_temporal, self.active_conv = temporal, conv

    # ------------------------------------------------------------------ memory
    @property
    def bytes_per_slot(self) -> int:
        b = self.q[0].numel() * self.q.element_size()
        if self.scale is not None:
            b += self.scale[0].numel() * 4
        if self.conv is not None:
            b += self.conv[0].numel() * self.conv.element_size()
        return b

    @staticmethod
    def estimate_bytes_per_slot(
        *, num_layers, num_heads, head_v_dim, head_k_dim, conv_numel=0, conv_dtype=torch.bfloat16, dtype="int8"
    ) -> int:
        dt = parse_checkpoint_dtype(dtype)
        n = num_layers * num_heads * head_v_dim * head_k_dim
        b = n * torch.empty((), dtype=dt).element_size()
        if dt == torch.int8:
            b += num_layers * num_heads * head_k_dim * 4
        return b + num_layers * conv_numel * torch.empty((), dtype=conv_dtype).element_size()

    # ------------------------------------------------------------------ lifecycle
    def available_size(self) -> int:
        return self._slots.available() if self._slots is not None else len(self._free)

    def alloc(self, n: int = 1) -> Optional[List[int]]:
        """n fresh writable slots with refcount 1, or None when fewer than n are free."""
        if self._slots is not None:
            out = []
            for _ in range(n):
                s = self._slots.alloc()
                if s is None:
                    for t in out:
                        self._slots.free(t)
                    return None
                out.append(s)
        elif n > len(self._free):
            return None
        else:
            out = [self._free.pop() for _ in range(n)]
        for s in out:
            self._ref[s] = 1
            self._sealed[s] = False
            self._layers_written[s] = set()
        return out

    def _check_live(self, s: int) -> None:
        if not (0 <= s < self.num_slots) or self._ref[s] <= 0:
            raise CheckpointError(f"checkpoint slot {s} is not allocated")

    def decref(self, slots: Sequence[int]) -> List[int]:
        """Drop one reference each; returns the slots that became free."""
        freed = []
        for s in slots:
            self._check_live(s)
            self._ref[s] -= 1
            if self._ref[s] == 0:
                self._sealed[s] = False
                self._layers_written[s] = set()
                if self._slots is not None:
                    self._slots.free(s)
                else:
                    self._free.append(s)
                freed.append(s)
        return freed

    free = decref

    # ------------------------------------------------------------------ lower tiers
    def slot_parts(self, s: int) -> list[torch.Tensor]:
        """The tensors of sealed slot ``s`` in a fixed order (values, int8 scales, conv state):
        what a lower tier keeps of a checkpoint, in its own dtype (int8 stays int8)."""
        self._check_live(s)
        if not self._sealed[s]:
            raise CheckpointError(f"checkpoint slot {s} is not sealed: nothing complete to read")
        return [t[s] for t in (self.q, self.scale, self.conv) if t is not None]

    def load_parts(self, s: int, parts: Sequence[torch.Tensor]) -> bool:
        """Write ``parts`` (as :meth:`slot_parts` gives them) into fresh slot ``s`` and seal it.
        A state with a non-finite scale or conv value is refused (False; the slot stays writable
        and the caller frees it), as :meth:`store` refuses one."""
        self._writable([s])
        dst = [t[s] for t in (self.q, self.scale, self.conv) if t is not None]
        if len(parts) != len(dst) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(parts, dst)):
            raise CheckpointError("checkpoint parts do not match this pool's format")
        floats = [torch.isfinite(p).all() for p in parts if p.is_floating_point()]
        if floats and not bool(torch.stack(floats).all()):  # one wait for all the parts
            return False
        for d, p in zip(dst, parts):
            d.copy_(p, non_blocking=False)
        self._layers_written[s] = set(range(self.L))
        self._sealed[s] = True
        return True

    # ------------------------------------------------------------------ data movement
    def _writable(self, ckpt_slots: Sequence[int]) -> None:
        if len(set(ckpt_slots)) != len(ckpt_slots):
            raise CheckpointError("duplicate checkpoint slots in one store")
        for s in ckpt_slots:
            self._check_live(s)
            if self._sealed[s]:
                raise CheckpointError(f"checkpoint slot {s} is sealed (read-only)")
            if self._ref[s] != 1:
                raise CheckpointError(f"checkpoint slot {s} is shared before it was stored")

    def _active(self, temporal, conv):
        t = temporal if temporal is not None else self.active_temporal
        c = conv if conv is not None else self.active_conv
        if t is None:
            raise CheckpointError("no active tensors: call bind_active() or pass them")
        return t, c

    def _finish(self, ckpt_slots: Sequence[int], bad: torch.Tensor, layers) -> StoreResult:
        bad_l = bad.tolist()  # one device->host sync per call
        if any(bad_l) and self._flags is not None:
            self._flags.zero_()
        accepted, rejected = [], []
        for s, b in zip(ckpt_slots, bad_l):
            if b:
                rejected.append(s)
                accepted.append(False)
            else:
                self._layers_written[s].update(layers)
                if len(self._layers_written[s]) == self.L:
                    self._sealed[s] = True
                accepted.append(True)
        if rejected:
            self._ref_release(rejected)
        return StoreResult(accepted, rejected)

    def _kw(self, t: torch.Tensor) -> dict:
        return (
            {"bad": self._flags}
            if (self._flags is not None and K.triton_available(t) and self.use_triton is not False)
            else {}
        )

    def _ref_release(self, slots):
        for s in slots:
            self._ref[s] = 1
        self.decref(slots)

    def store(
        self,
        active_slots: Sequence[int],
        ckpt_slots: Sequence[int],
        *,
        temporal: Optional[torch.Tensor] = None,
        conv: Optional[torch.Tensor] = None,
    ) -> StoreResult:
        """Copy (int8: quantize) every layer of ``active_slots`` into ``ckpt_slots`` (pairwise) and
        seal them. Refused pairs (non-finite) release their checkpoint slot."""
        active_slots, ckpt_slots = list(active_slots), list(ckpt_slots)
        if len(active_slots) != len(ckpt_slots):
            raise ValueError("active_slots and ckpt_slots differ in length")
        self._writable(ckpt_slots)
        t, c = self._active(temporal, conv)
        if not active_slots:
            return StoreResult([], [])
        if self.dtype == torch.int8:
            bad = K.quant_scatter(
                t, c, active_slots, self.q, self.scale, self.conv, ckpt_slots, use_triton=self.use_triton, **self._kw(t)
            )
        else:
            bad = K.copy_to_ckpt(
                t, c, active_slots, self.q, self.conv, ckpt_slots, use_triton=self.use_triton, **self._kw(t)
            )
        return self._finish(ckpt_slots, bad, range(self.L))

    def restore(
        self,
        ckpt_slots: Sequence[int],
        active_slots: Sequence[int],
        *,
        temporal: Optional[torch.Tensor] = None,
        conv: Optional[torch.Tensor] = None,
    ) -> None:
        """Copy-on-write: write sealed checkpoints into private active slots (full precision)."""
        ckpt_slots, active_slots = list(ckpt_slots), list(active_slots)
        if len(active_slots) != len(ckpt_slots):
            raise ValueError("active_slots and ckpt_slots differ in length")
        if len(set(active_slots)) != len(active_slots):
            raise CheckpointError("duplicate active slots in one restore")
        for s in ckpt_slots:
            self._check_live(s)
            if not self._sealed[s]:
                raise CheckpointError(f"checkpoint slot {s} has not been stored completely")
        t, c = self._active(temporal, conv)
        if not ckpt_slots:
            return
        if self.dtype == torch.int8:
            K.gather_dequant(self.q, self.scale, self.conv, ckpt_slots, t, c, active_slots, use_triton=self.use_triton)
        else:
            K.copy_from_ckpt(self.q, self.conv, ckpt_slots, t, c, active_slots, use_triton=self.use_triton)

    def store_from_intermediate(
        self,
        layer: Union[int, Sequence[int]],
        h: torch.Tensor,
        chunk_idx: Sequence[int],
        ckpt_slots: Sequence[int],
        *,
        state_v_first: bool = False,
        conv_src: Optional[torch.Tensor] = None,
        token_ends: Optional[Sequence[int]] = None,
    ) -> StoreResult:
        """Store layer ``layer`` of ``ckpt_slots`` straight from chunk_kda's intermediate states
        ``h`` (bf16, ``[B, NT, HV, K, V]``, or ``[B, NT, HV, V, K]`` with ``state_v_first``);
        ``chunk_idx`` indexes ``h``'s flattened ``B*NT`` axis (see
        ``sglang_k3.kernels.ckpt.intermediate_chunk_index``). The conv window at each boundary is
        gathered from ``conv_src`` (the layer's pre-conv token stream ``[T, D]``) ending at
        ``token_ends`` (absolute rows). A slot is sealed once all layers are stored; a non-finite
        layer refuses (releases) the whole slot.

        ``layer`` a run of consecutive layers (e.g. ``range(pool.L)``): ``h`` and ``conv_src``
        carry one leading entry per layer, and all of them are stored in one launch with one
        device->host sync for the refusal flags (instead of one of each per layer)."""
        ckpt_slots = list(ckpt_slots)
        layers = [layer] if isinstance(layer, int) else [int(x) for x in layer]
        if not layers or any(not 0 <= x < self.L for x in layers):
            raise ValueError(f"layer {layer} out of range")
        self._writable(ckpt_slots)
        for s in ckpt_slots:
            again = self._layers_written[s].intersection(layers)
            if again:
                raise CheckpointError(f"layer(s) {sorted(again)} of checkpoint slot {s} already stored")
        if (conv_src is None) != (self.conv is None):
            raise ValueError("conv_src is required exactly when the pool holds conv states")
        if not ckpt_slots:
            return StoreResult([], [])
        bad = K.store_intermediate(
            h,
            list(chunk_idx),
            layer,
            self.q,
            self.scale,
            ckpt_slots,
            state_v_first=state_v_first,
            conv_src=conv_src,
            token_ends=token_ends,
            dst_conv=self.conv,
            use_triton=self.use_triton,
            **self._kw(h),
        )
        return self._finish(ckpt_slots, bad, layers)
