"""Reject a request with no input tokens with a clear 400.

SGLang 0.5.23 accepts an empty prompt (``"text": ""`` or ``"input_ids": []``) and schedules a
zero-length extend: there is no last position to sample from, and on CPU the KDA conv of a
zero-length sequence used to kill the scheduler. A ``ValueError`` from this validator becomes a
400 response, like upstream's context-length check in the same function.
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
REASON = "an empty prompt must be a 400, not a zero-length extend in the scheduler"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def reject_empty_input(self, obj, input_ids, *args, **kwargs):
    has_embeds = getattr(obj, "input_embeds", None) is not None
    if input_ids is not None and len(input_ids) == 0 and not has_embeds:
        raise ValueError("The input is empty: a request needs at least one input token.")
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, reject_empty_input, HookType.BEFORE)
