"""Reject a request with no input tokens, or with a token id outside the vocabulary, with a clear 400.

SGLang 0.5.23 accepts an empty prompt (``"text": ""`` or ``"input_ids": []``) and schedules a
zero-length extend: there is no last position to sample from, and on CPU the KDA conv of a
zero-length sequence used to kill the scheduler.

It also passes caller-given ``input_ids`` to the scheduler unchecked. A negative id or one past
the embedding table (e.g. ``10**7``) raises ``IndexError`` in ``embed_tokens`` inside the
scheduler, and every server process exits; an id that falls in the table's padding (e.g. one
equal to the vocab size) is silently embedded from a row that holds no weights. The valid range
is the embedding table's loaded rows, ``[0, hf_text_config.vocab_size)``: the config value
``KimiLinearModel`` (like SGLang's other decoders) builds
``embed_tokens = VocabParallelEmbedding(config.vocab_size, ...)`` from.
(``model_config.vocab_size`` equals it except where it names an output head instead, as for
GLM-Image.) Every request reaches this validator once per prompt: ``/generate`` single and
batch (``obj[i]`` per item) and ``/v1/completions`` with token-id prompts (``input_ids=prompt``).

A ``ValueError`` from this validator becomes a 400 response, like upstream's context-length check
in the same function.
"""

from __future__ import annotations

from numbers import Integral

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
REASON = "an empty prompt or an out-of-vocabulary input id must be a 400, not a scheduler failure"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def validate_input_ids(self, obj, input_ids, *args, **kwargs):
    """BEFORE hook: raise ``ValueError`` (a 400) for ids the scheduler could not embed."""
    if getattr(obj, "input_embeds", None) is not None:  # the ids are not embedded
        return None
    if input_ids is None:
        return None
    _reject_empty(input_ids)
    # A multimodal processor has rewritten the ids with its own placeholders; the scheduler
    # replaces those before embedding, so the text vocabulary does not bound them here.
    if not obj.contains_mm_input():
        _reject_out_of_vocab(input_ids, self.model_config.hf_text_config.vocab_size)
    return None


def _reject_empty(input_ids) -> None:
    if len(input_ids) == 0:
        raise ValueError("The input is empty: a request needs at least one input token.")


def _reject_out_of_vocab(input_ids, vocab_size: int) -> None:
    bad = next(((i, t) for i, t in enumerate(input_ids) if not (isinstance(t, Integral) and 0 <= t < vocab_size)), None)
    if bad is not None:
        i, t = bad
        raise ValueError(
            f"input_ids[{i}] = {t!r} is out of range: token ids must be integers in "
            f"[0, {vocab_size}), the rows of the model's embedding table."
        )


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_input_ids, HookType.BEFORE)
