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

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        """EAGLE and EAGLE3 with a draft model: their draft's ops run in torch here
        (``kernels/spec``, ``patches/spec_*``), draft chains
        (:func:`~sglang_k3.integration.k3_args.check_speculative`). SGLang asks before it builds a
        draft worker (``_check_oot_speculative_algorithm``); NGRAM's path does not ask."""
        from sglang_k3.integration.k3_args import DRAFT_MODEL_ALGORITHMS

        return str(algorithm).upper() in DRAFT_MODEL_ALGORITHMS
