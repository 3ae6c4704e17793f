"""What the k3 cache shares with the forward pass: its export stash and its deferred restores.

The cache owns both (one per cache, no module globals). The forward reaches them through the
object SGLang already hands to both sides: the ``HybridReqToTokenPool`` that the cache receives in
``CacheInitParams.req_to_token_pool`` and the KDA attention backend holds as
``self.req_to_token_pool``. The cache attaches its :class:`ForwardState` there when it is built;
the patches in ``patches/kda_backend_forward_extend.py`` and ``patches/kda_triton_extend_export.py``
read it with :func:`attached`. A pool with nothing attached (upstream's cache, a disabled cache)
leaves the forward untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sglang_k3.state.deferred_restore import DeferredRestores
from sglang_k3.state.export_stash import ExportStash

_ATTR = "_sglang_k3_forward_state"


@dataclass
class ForwardState:
    stash: ExportStash
    restores: DeferredRestores


def attach(req_to_token_pool: Any, state: ForwardState) -> None:
    setattr(req_to_token_pool, _ATTR, state)


def attached(req_to_token_pool: Any) -> Optional[ForwardState]:
    return getattr(req_to_token_pool, _ATTR, None)
