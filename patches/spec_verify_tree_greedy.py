"""Speculative decoding on CPU: ``verify_tree_greedy_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.verify_tree_greedy`, upstream's contract)."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
REASON = "greedy verify of the draft tree has no path off CUDA/HIP/XPU/NPU (reject_out_of_tree_path)"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.verify_tree_greedy)
