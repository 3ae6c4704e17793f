"""Admission budgets per request class (``--k3-admission-thresholds``): hold a request in the
tokenizer manager until its prompt-length class has room, then send it to the scheduler.

SGLang 0.5.23 sends every tokenized request to the scheduler at once, and the scheduler's waiting
queue has no notion of a class's share: a burst of long prompts queued ahead of a short one delays
the short one's first token by the whole burst's prefill. The budget has to be applied before the
request reaches the scheduler, where the prompt is tokenized (so its length is known) and nothing
is allocated yet: ``_send_one_request``. ``tokenizer_manager_admission_release.py`` gives the
budget back at the request's first output. A request that fails before it is sent releases here.
Requests of one ``/generate`` batch go through ``_send_batch_request`` and are not budgeted.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request"
REASON = "a burst of long prompts must not take more than its class's share of prefill capacity"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


async def admit_then_send(original, self, tokenized_obj, *args, **kwargs):
    from sglang_k3.integration.admission import admission_of

    ctl = admission_of(self)
    input_ids = getattr(tokenized_obj, "input_ids", None)
    if ctl is None or input_ids is None:
        return await original(self, tokenized_obj, *args, **kwargs)
    rid = tokenized_obj.rid
    await ctl.acquire(rid, len(input_ids))
    try:
        return await original(self, tokenized_obj, *args, **kwargs)
    except BaseException:
        ctl.release(rid)
        raise


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, admit_then_send, HookType.AROUND)
