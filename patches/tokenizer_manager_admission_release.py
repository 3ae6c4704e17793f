"""Admission budgets (``--k3-admission-thresholds``): a request gives its class's budget back at
its first response, or when it ends in any other way.

``TokenizerManager.generate_request`` yields a request's responses as the scheduler sends them:
with ``stream``, the first one is its first token, so its prefill is done; without, SGLang sends
nothing before the request finishes, so it holds until then. The generator's ``finally`` covers
every other end: an error, an abort, a client that went away, or a cancelled caller (SGLang's own
``/health`` cancels its one-token request as soon as the scheduler answers anything, and aborts it;
no response for it ever comes back, so a release tied to responses alone leaked its budget).
Nothing in SGLang tells an extension that a request's prefill ended or that it was dropped, hence
a hook around the generator.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
REASON = "the admission budget of a request must be given back when its prefill is done or it ends"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


async def release_at_first_response(original, self, obj, *args, **kwargs):
    from sglang_k3.integration.admission import admission_of

    ctl = admission_of(self)  # built here on a server's first request, before it is admitted
    release = None if ctl is None else ctl.release
    released = release is None
    try:
        async for response in original(self, obj, *args, **kwargs):
            if not released:
                released = True
                _release(release, obj)
            yield response
    finally:
        if not released:
            _release(release, obj)


def _release(release, obj) -> None:
    rid = getattr(obj, "rid", None)
    if isinstance(rid, str):  # one request (a batch's requests are not budgeted)
        release(rid)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, release_at_first_response, HookType.AROUND)
