"""NGRAM's draft-tree indices in torch, in place of a module that cannot be imported here.

``sglang.kernels.ops.speculative.reconstruct_tree`` imports ``sgl_kernel.speculative`` at module
level on any host that is not CUDA, HIP or XPU, and the CUDA wheel's ``sgl_kernel`` fails to load
without ``libcuda``. ``sglang.srt.speculative.ngram_worker`` imports the module at its top, so
NGRAM cannot even be selected on the CPU platform. No hook can reach a function of a module that
fails to import, so ``register`` puts a module of the same name in ``sys.modules`` (before any
importer runs: plugins load first) whose ``reconstruct_indices_from_tree_mask_func`` is
:func:`sglang_k3.kernels.spec.spec_torch.reconstruct_indices_from_tree_mask` (upstream's
contract, stated in its docstring). Where the real module imports, it is left alone.
"""

from __future__ import annotations

import sys
import types

TARGET = "sglang.kernels.ops.speculative.reconstruct_tree.reconstruct_indices_from_tree_mask_func"
REASON = "the module imports sgl_kernel.speculative at load on a CPU host; NGRAM's worker imports it"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True

_MODULE = TARGET.rsplit(".", 1)[0]


def register() -> None:
    import importlib

    import torch

    if torch.cuda.is_available() or _MODULE in sys.modules:
        return
    try:
        importlib.import_module(_MODULE)
        return  # it loads here: upstream's own kernel dispatch stands
    except Exception:  # noqa: BLE001 - sgl_kernel fails with ImportError or OSError (no libcuda)
        sys.modules.pop(_MODULE, None)
    from sglang_k3.kernels.spec import spec_torch

    mod = types.ModuleType(_MODULE, __doc__)
    mod.reconstruct_indices_from_tree_mask_func = spec_torch.reconstruct_indices_from_tree_mask
    sys.modules[_MODULE] = mod
    parent = importlib.import_module(_MODULE.rsplit(".", 1)[0])
    setattr(parent, _MODULE.rsplit(".", 1)[1], mod)
