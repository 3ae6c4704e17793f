"""Changes to upstream SGLang behaviour that no registry offers.

One module per upstream symbol. Each module defines:

- ``TARGET``: the dotted upstream path it hooks (as ``HookRegistry`` takes it);
- ``REASON``: one line, why the change is needed;
- ``UPSTREAM_VERSION``: the sglang version the hook was written against;
- ``register()``: registers its hook(s) with ``sglang.srt.plugins.hook_registry.HookRegistry``.

``register_all()`` is called by the ``sglang.srt.plugins`` entry point
(``sglang_k3.integration.plugin:load``) in every SGLang process; SGLang then applies the hooks.
Modules are listed explicitly so the order is stable and a missing module fails loudly.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

# Filled in as patch modules are added (module names relative to this package).
PATCH_MODULES: list[str] = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "rms_norm_gated",
    "kda_triton_kernel",
    "kda_backend_forward_extend",
    "kda_triton_extend_export",
    "tokenizer_manager_validate",
    "tokenizer_manager_admission",
    "tokenizer_manager_admission_release",
    "batch_result_decode_checkpoint",
    "scheduler_internal_state_k3",
    "scheduler_process_batch_result_k3",
    "match_kv_cache_k3",
    "scheduler_output_streamer_k3",
    "kv_cache_configurator_init_pools",
    "mamba_track_states",
    "schedule_batch_decode_pin",
    "mamba_no_buffer_overlap",
    "schedule_policy_waiting_refresh",
    "prefill_adder_not_admitted",
    "scheduler_hold_tier_loads",
    "spec_reconstruct_tree",
    "ngram_chain_drafts",
    "spec_assign_req_to_token_pool",
    "spec_fill_front_out_cache_loc",
    "spec_fill_accept_out_cache_loc",
    "spec_verify_tree_greedy",
    "spec_scatter_mamba_states",
    "torch_native_target_verify",
    "spec_finish_rewind",
    "kimi_linear_eagle",
    "spec_mha_kv_copy",
    "spec_draft_backend_torch_native",
    "spec_assign_draft_cache_locs",
    "spec_build_tree",
    "spec_fill_bonus_tokens",
]

_registered = False


def replace_unless_cuda(target: str, fn) -> bool:
    """Register ``fn`` as a REPLACE hook on ``target``, unless CUDA is present (a CUDA machine
    keeps upstream's GPU kernel). Returns whether it registered. Shared by the CPU kernel patches."""
    import torch

    if torch.cuda.is_available():
        logger.debug("CUDA present: keeping upstream %s", target)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, fn, HookType.REPLACE)
    return True


def register_all(only_cpu: bool | None = None) -> list[str]:
    """Register every patch; returns the targets registered (idempotent per process)."""
    global _registered
    targets: list[str] = []
    if _registered:
        return targets
    _registered = True
    for name in PATCH_MODULES:
        mod = importlib.import_module(f"{__name__}.{name}")
        if only_cpu is not None and getattr(mod, "CPU_ONLY", False) and not only_cpu:
            continue
        mod.register()
        targets.append(mod.TARGET)
        logger.info("sglang-k3 patch %s -> %s (%s)", name, mod.TARGET, mod.REASON)
    return targets
