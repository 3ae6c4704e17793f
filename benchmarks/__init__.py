"""Benchmarks for sglang-k3: trace replay (``python -m benchmarks.trace_replay``), GPU kernel bench."""
