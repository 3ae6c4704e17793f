"""Pure-torch versions of SGLang's speculative-decoding index ops (the CPU path).

SGLang 0.5.23 runs these as Triton or ``sgl_kernel`` kernels (``sglang.kernels.ops.speculative``,
``sglang.srt.mem_cache.allocation``); its own CPU branches call ``sgl_kernel`` CPU ops that the
CUDA wheel does not have. Each function here keeps upstream's contract (argument names, in-place
outputs) so ``patches/`` can put it in the kernel's place: ``spec_torch`` for the request-to-token
and cache-location bookkeeping, the draft tree's indices and the greedy verify. The commit of the
accepted step's KDA state uses SGLang's own torch fallback (``patches/spec_scatter_mamba_states.py``).
"""
