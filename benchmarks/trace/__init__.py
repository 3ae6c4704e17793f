"""Mooncake-format trace loading and its deterministic conversion to token sequences."""

from benchmarks.trace.mooncake import (
    SymbolicTrace,
    TraceError,
    TraceRequest,
    load_trace,
    to_symbolic,
)

__all__ = ["TraceError", "TraceRequest", "SymbolicTrace", "load_trace", "to_symbolic"]
