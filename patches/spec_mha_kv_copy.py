"""Speculative decoding on CPU: an EAGLE draft's MHA KV pool moves accepted draft KV with torch.

With a speculative algorithm SGLang 0.5.23 builds MHA KV pools (the EAGLE draft's) with
``enable_kv_cache_copy``, whose ``MHATokenToKVPool._init_kv_copy_and_warmup`` configures and warms
a Triton tiled copy (``kernels/ops/kvcache/cache_move.py``): without a GPU Triton has no driver and
the draft worker dies building its pool. On CPU the pool uses SGLang's own native move instead
(``move_kv_cache_native``, its ``SGLANG_NATIVE_MOVE_KV_CACHE`` path), so there is nothing to warm."""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
REASON = "the draft's MHA pool warms a Triton KV copy under speculation; no Triton driver on CPU"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def native_kv_move(self) -> None:
    self._kv_copy_config = None
    self.use_native_move_kv_cache = True


def register() -> None:
    from sglang_k3.patches import replace_unless_cuda

    replace_unless_cuda(TARGET, native_kv_move)
