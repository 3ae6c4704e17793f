"""Let ``--radix-cache-backend k3`` run with SGLang's overlap scheduler under ``no_buffer``.

SGLang 0.5.23 refuses ``no_buffer`` with the overlap scheduler on
(``arg_groups/mamba_hook.py::validate_mamba_no_buffer``). The reason is upstream's own cache: its
``no_buffer`` copies a request's live state slot into the tree when the request's result is
processed, and under overlap the next forward has already advanced that slot (a prompt-end state
would be stored one decode token late). The k3 cache does not depend on that ordering:

* a live slot is copied only when its state length (``req.kv.kv_committed_len``: SGLang counts
  a step's tokens when it prepares the step, before launching it, so the slot holds exactly
  that many tokens in stream order) equals the boundary it is stored under
  (``CacheLifecycle.checkpoint_running`` and ``finish``); otherwise nothing is stored there;
* boundaries inside an extend come from the states that extend itself exported
  (``sglang_k3/state/export_stash.py``), which later forwards do not overwrite.

The same check asserts ``--page-size 1``: upstream's ``no_buffer`` keys its single state per
node at any token. The k3 tree keeps whole KV pages of a running request (a boundary inside its
last page is not stored; the 64-token grid state below it is), keeps a finished request's partial
last page with the state at its exact end, and copies that page's slots when a request restores
inside it; so for k3 a page size that nests with the 64-token grid passes (``check_page_size``), and
``launch_server`` and the cache refuse others with the reason.

So for a k3 backend this AROUND hook lets the overlap scheduler stay on and the page size be one
that k3 takes, and still checks ``no_buffer``'s other condition (no ``trtllm_mha``). Every other
backend keeps upstream's check unchanged.
"""

from __future__ import annotations

TARGET = "sglang.srt.arg_groups.mamba_hook.validate_mamba_no_buffer"
REASON = (
    "k3 guards its state copies by state length and keys states at page boundaries, so no_buffer may run "
    "with the overlap scheduler and pages that nest with the 64-token state grid (powers of two up to 256)"
)
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


class _OverlapAllowed:
    """The server-args view with the overlap and page-size checks answered for k3, everything else
    read through."""

    def __init__(self, view) -> None:
        self._view = view

    def __getattr__(self, name: str):
        if name == "disable_overlap_schedule":
            return True
        if name == "page_size":
            page = getattr(self._view, name)
            return 1 if page and _k3_serves(page) else page  # others: upstream's assertion stands
        return getattr(self._view, name)


def _k3_serves(page: int) -> bool:
    from sglang_k3.cache.build import check_page_size

    try:
        check_page_size(page)
    except ValueError:
        return False
    return True


def validate_no_buffer(original_fn, view, *args, **kwargs):
    if getattr(view, "radix_cache_backend", None) == "k3":
        view = _OverlapAllowed(view)
    return original_fn(view, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_no_buffer, HookType.AROUND)
