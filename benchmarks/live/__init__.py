"""Pieces of the live A/B harness (``python -m benchmarks.live_ab``): real servers, a streaming
client, and the workloads."""
