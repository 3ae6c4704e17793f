"""Mooncake-format trace loading and its deterministic conversion to token sequences."""
from benchmarks.trace.mooncake import (
    TraceError, TraceRequest, SymbolicTrace, load_trace, to_symbolic,
)

__all__ = ["TraceError", "TraceRequest", "SymbolicTrace", "load_trace", "to_symbolic"]
