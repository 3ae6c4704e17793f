"""Ask the KDA extend kernel for its chunk-boundary states and hand them to the export stash.

``chunk_kda`` computes the state at every 64-token boundary in the same forward; asking for it
costs no second pass (measured on the H200: no slower than without). When the backend hook marked
an extend as recorded, this AROUND hook sets ``return_intermediate_states=True``, hands ``h`` and
the layer's pre-conv rows to the stash (which copies out only the planned boundary rows; the full
tensors are released when the layer returns) and returns the output alone, as the caller expects.
"""

from __future__ import annotations

from sglang_k3.state.export_context import CURRENT_EXTEND

TARGET = "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel.extend"
REASON = "the k3 cache stores chunk-boundary states from the extend itself, never by replay"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def extend_exporting(original, self, *args, **kwargs):
    current = CURRENT_EXTEND.get()
    if current is None or kwargs.get("return_intermediate_states"):
        return original(self, *args, **kwargs)
    kwargs["return_intermediate_states"] = True
    o, h = original(self, *args, **kwargs)
    current.stash.record_layer(current.layer_id, h, current.mixed_qkv)
    return o


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, extend_exporting, HookType.AROUND)
