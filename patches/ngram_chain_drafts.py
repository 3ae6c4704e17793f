"""NGRAM drafts as one chain on CPU (``--speculative-ngram-max-bfs-breadth 1``).

With a breadth of 1 SGLang's n-gram corpus still returns small trees: a miss comes back as the
root with padding tokens as its children (a star), a short match as a chain with padding
siblings under its last node. SGLang then takes ``topk == 1`` to mean a chain for the KDA layers
(no ``retrieve_*`` indices: each draft token's state follows the one before it) while attention
applies the tree mask, so an accepted padding sibling would get a state computed after a token
that is not its ancestor. The CPU path verifies chains only (``patches/torch_native_target_verify``,
``kda_triton_kernel.target_verify_cpu``), so with ``topk == 1`` this hook hands the worker the
same draft tokens with a chain mask: every draft follows the one before it. Any chain is a valid
guess: greedy verify still accepts exactly the drafts that equal the target's own greedy tokens,
so the output is unchanged; only which guesses are made differs.
"""

from __future__ import annotations

TARGET = "sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_draft_tokens"
REASON = "with breadth 1 the corpus returns draft trees that SGLang's topk==1 KDA verify treats as chains"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = True


def as_chain(result, self, batch, *args, **kwargs):
    import numpy as np

    if self.topk != 1:
        return result
    drafts, mask = result
    n = self.draft_token_num
    bs = len(drafts) // n
    chain = np.tril(np.ones((n, n), dtype=mask.dtype))
    return drafts, np.tile(chain.reshape(-1), bs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, as_chain, HookType.AFTER)
