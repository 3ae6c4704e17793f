"""The CPU platform plugin (entry point group ``sglang.srt.platforms``).

SGLang's in-tree CPU platform is chosen only with ``SGLANG_USE_CPU_ENGINE=1`` and then routes
many ops to ``sgl_kernel``'s CPU build, which the PyPI wheel does not carry. An out-of-tree
(``OOT``) subclass of ``CpuSRTPlatform`` keeps the CPU device handling but lets the model run its
native torch paths; the Triton-only pieces of the KDA path are replaced in ``patches/``.

The plugin activates only where it is wanted: when CUDA is absent, or when ``SGLANG_K3_CPU=1``
asks for it on a CUDA host. It returns ``None`` otherwise, so a CUDA machine keeps upstream's
CUDA platform and kernels.
"""

from __future__ import annotations

import os

ENV_FORCE_CPU = "SGLANG_K3_CPU"

# The class lives in `platform.py`; SGLang imports it by name only after activation. This module
# must not import sglang: SGLang loads it while `sglang.srt.platforms` is still initialising.
PLATFORM_CLASS = "sglang_k3.integration.platform.K3CpuPlatform"


def cpu_platform_wanted() -> bool:
    """True when sglang-k3 should serve on the CPU in this process."""
    forced = os.environ.get(ENV_FORCE_CPU)
    if forced is not None:
        return forced == "1"
    import torch

    return not torch.cuda.is_available()


def activate() -> str | None:
    """Entry point: the platform class path when active, else ``None``."""
    return PLATFORM_CLASS if cpu_platform_wanted() else None
