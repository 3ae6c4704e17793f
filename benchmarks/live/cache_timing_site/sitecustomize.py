"""Start-up hook of :mod:`benchmarks.live.cache_timing` (active only with SGLANG_K3_CACHE_TIMING_DIR set)."""

import os

if os.environ.get("SGLANG_K3_CACHE_TIMING_DIR"):
    import sys

    # appended, not first: on the GPU the installed sglang_k3 must win over the checkout's
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    from benchmarks.live import cache_timing

    cache_timing.install()
