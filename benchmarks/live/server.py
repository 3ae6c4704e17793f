"""The server handle the live A/B and the tests use; it lives in :mod:`sglang_k3.fleet.instance`
(``scripts/start_fleet.py`` starts its instances with it too)."""

from sglang_k3.fleet.instance import Server, ServerStartError, flush_cache, free_port  # noqa: F401
