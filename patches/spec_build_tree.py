"""Speculative decoding on CPU: ``build_tree_kernel_efficient_func`` in torch
(:func:`sglang_k3.kernels.spec.spec_torch.build_tree_kernel_efficient`, upstream's contract).
SGLang 0.5.23 refuses the call on an out-of-tree platform (``reject_out_of_tree_path``: "EAGLE
tree construction")."""

from __future__ import annotations

TARGET = "sglang.kernels.ops.speculative.spec_tree.build_tree_kernel_efficient_func"
REASON = "an EAGLE verify's tree is built by a CUDA/Triton kernel that refuses an out-of-tree platform"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def register() -> None:
    from sglang_k3.kernels.spec import spec_torch
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, spec_torch.build_tree_kernel_efficient)
