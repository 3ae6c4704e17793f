"""Pure-torch versions of SGLang's speculative-decoding index and state ops (the CPU path).

SGLang 0.5.23 runs these as Triton or ``sgl_kernel`` kernels (``sglang.kernels.ops.speculative``,
``sglang.kernels.ops.mamba.mamba_state_scatter_triton``, ``sglang.srt.mem_cache.allocation``);
its own CPU branches call ``sgl_kernel`` CPU ops that the CUDA wheel does not have. Each function
here keeps upstream's contract (argument names, in-place outputs) so ``patches/`` can put it in
the kernel's place: ``spec_torch`` for the request-to-token and cache-location bookkeeping, the
draft tree's indices, the greedy verify and the commit of the accepted step's KDA state.
"""
