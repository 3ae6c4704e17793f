"""The general plugin (entry point group ``sglang.srt.plugins``), loaded by every SGLang process.

It registers what sglang-k3 adds through upstream's own registries (radix-cache backends, the MLA
handler for ``torch_native``) and the hooks in ``patches/`` that no registry offers. SGLang calls
``HookRegistry.apply_hooks()`` right after the plugins ran.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sglang_k3 import patches
    from sglang_k3.integration import mla_backend, radix_backends
    from sglang_k3.integration.platform_entry import cpu_platform_wanted

    radix_backends.register()
    on_cpu = cpu_platform_wanted()
    if on_cpu:
        mla_backend.register()
    targets = patches.register_all(only_cpu=on_cpu)
    logger.info("sglang-k3 plugin loaded (cpu=%s, %d patches)", on_cpu, len(targets))
