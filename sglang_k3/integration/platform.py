"""The CPU platform class; activated by ``platform_entry.activate`` (see there for when)."""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum


class K3CpuPlatform(CpuSRTPlatform):
    """CPU serving for hybrid KDA/MLA models through SGLang's own server."""

    _enum = PlatformEnum.OOT

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def support_mamba_cache_extra_buffer(self) -> bool:
        """SGLang's ``extra_buffer`` state tracking runs here: its Triton track copy and its
        unguarded pin_memory() have CPU patches (patches/mamba_track_states.py,
        patches/schedule_batch_decode_pin.py). Not k3's strategy: ``--radix-cache-backend
        upstream --mamba-radix-cache-strategy extra_buffer`` is the live A/B's faithful
        baseline."""
        return True

    def get_speculative_cache_locs_fn(self):
        """The KV locations of a verify's draft tokens (``assign_extend_cache_locs_func``), in
        torch: SGLang's kernels for it are Triton or ``sgl_kernel`` CPU ops the CUDA wheel lacks."""
        from sglang_k3.kernels.spec.spec_torch import assign_extend_cache_locs

        return assign_extend_cache_locs
