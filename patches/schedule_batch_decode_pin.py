"""Let ``ScheduleBatch.prepare_for_decode`` run under ``extra_buffer`` on a machine without CUDA.

SGLang 0.5.23 builds the decode step's state-track mask with ``track_mask_cpu.pin_memory()``
(``managers/schedule_batch.py``, ``prepare_for_decode``, the ``extra_buffer`` branch). It is the
one call there that does not ask ``is_pin_memory_available(self.device)`` first, as every other
host tensor of the batch does; without a CUDA driver ``pin_memory()`` raises, and the scheduler
dies on the first decode step. Around that method, on a host without CUDA, ``pin_memory`` returns
the tensor itself: the mask is then copied to the (CPU) device from pageable memory, as upstream
does wherever pinning is unavailable. Nothing changes on a CUDA machine (the hook is not
registered there).
"""

from __future__ import annotations

import contextlib

import torch

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
REASON = "extra_buffer's decode track mask calls pin_memory() unguarded; it raises without CUDA"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False  # a scheduler hook; register() itself skips CUDA machines


@contextlib.contextmanager
def pageable_pin_memory():
    """Within the block, ``Tensor.pin_memory()`` returns the tensor (no CUDA to pin with)."""
    original = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original


def prepare_for_decode_cpu(original_fn, *args, **kwargs):
    with pageable_pin_memory():
        return original_fn(*args, **kwargs)


def register() -> None:
    if torch.cuda.is_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, prepare_for_decode_cpu, HookType.AROUND)
