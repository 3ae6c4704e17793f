"""The admission budgets of one server (:mod:`sglang_k3.fleet.admission`), attached to SGLang's
``TokenizerManager``: its patches (``patches/tokenizer_manager_admission*.py``) acquire before a
request is sent to the scheduler and release at the request's first output; the ``/k3_fleet_info``
endpoint (:mod:`sglang_k3.fleet.instance_info`) reports them."""

from __future__ import annotations

from typing import Any, Optional

from sglang_k3.fleet.admission import AdmissionControl, policy_from_config

ATTR = "_k3_admission"
_OFF = object()  # budgets off for this tokenizer manager (looked up once)


def server_capacity_tokens(server_args: Any) -> int:
    """SGLang's prefill capacity per step: the chunk size, or the prefill token cap without chunking.
    Read through SGLang's resolving view: the raw ``chunked_prefill_size`` is None until SGLang's
    resolution decides it per platform (4096 on this CPU path), and only the view sees that."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    view = resolving_view(server_args)
    chunk = getattr(view, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(getattr(view, "max_prefill_tokens", None) or 16384)


def admission_of(tokenizer_manager: Any) -> Optional[AdmissionControl]:
    """The tokenizer manager's budgets, built on first use from the published config; None when off."""
    ctl = getattr(tokenizer_manager, ATTR, None)
    if ctl is None:
        from sglang_k3.config import from_env

        policy = policy_from_config(from_env(), server_capacity_tokens(tokenizer_manager.server_args))
        ctl = _OFF if policy is None else AdmissionControl(policy)
        setattr(tokenizer_manager, ATTR, ctl)
    return None if ctl is _OFF else ctl
