"""Pure-torch KDA (Kimi Delta Attention) kernels: the CPU path and the reference for GPU kernels.

- ``gate_torch``: KDA gate activation (softplus or safe/lower-bound gate) and q/k L2 norm.
- ``chunk_torch``: chunked (WY/UT-transform) prefill over varlen batches with initial states;
  also returns the state at every 64-token chunk boundary.
- ``recurrent_torch``: token-by-token recurrence (decode; also the oracle for the chunked form).
- ``conv1d_torch``: causal depthwise conv1d, varlen prefill with conv-state in/out, and update.
- ``gated_rmsnorm_torch``: gated RMSNorm (the KDA output norm).
- ``pool_ops``: the above called the way SGLang's KDA backend calls its kernels: state pools
  indexed by slot, upstream's ``[slots, H, V, K]`` recurrent-state layout, raw gates and betas.
"""
