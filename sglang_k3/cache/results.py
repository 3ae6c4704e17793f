"""Return types of the tree's lookups and inserts. Plain ints and lists, so callers (the SGLang
wrapper, the trace-replay simulator) convert them to tensors as they need. What the tree gives
back (frees, demotions) is in :mod:`sglang_k3.cache.actions`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_k3.cache.node import Checkpoint, Node


@dataclass(eq=False)
class Pin:
    """Holds a matched checkpoint (all groups at once) and the KV path under it until the
    caller's copy-on-write out of the checkpoint has landed. Release with ``tree.release_pin``."""

    checkpoint: Checkpoint
    node: Node
    released: bool = False


@dataclass
class MatchResult:
    """Outcome of the two-phase lookup.

    ``mla_len``: longest token prefix whose KV is in the tree (phase 1).
    ``restore_len``: the restore boundary (phase 2): a multiple of the hit unit, ``<= mla_len`` and
    ``<= len(key) - 1``, with a ready checkpoint in every KDA group; 0 means a miss.
    ``kv_indices``: KV pool indices of tokens ``[0, restore_len)`` (exactly ``restore_len`` long).
    ``handles``: one checkpoint handle per KDA group to copy from (empty on a miss).
    ``node``: the node holding the restore boundary (``start < restore_len <= end``), root on a
    miss. Lock it (``inc_lock_ref``) for the request's lifetime.
    ``pin``: set when ``pin=True`` and there is a hit; release after the COW lands.
    ``kv_cow_tokens``: ``restore_len % page_size``: the last page is shared with the tree and only
    that many of its slots belong to the prefix; the caller must copy them to a private page
    before extending (never write into a tree page).
    ``replayed_tokens``: ``mla_len' - restore_len`` where mla_len' is mla_len capped at len-1: the
    tokens present as KV but recomputed because no checkpoint sits closer.
    """

    mla_len: int
    restore_len: int
    kv_indices: list[int]
    handles: list[int]
    node: Node
    checkpoint: Optional[Checkpoint] = None
    pin: Optional[Pin] = None
    kv_cow_tokens: int = 0
    replayed_tokens: int = 0


@dataclass
class InsertResult:
    """``prefix_len``: leading tokens already in the tree before this insert.
    ``inserted_len``: the length the tree now holds for this key: ``len(key)`` rounded down to
    ``page_size``, or all of it for a ragged insert; ``kv[inserted_len:]`` stays the caller's.
    ``duplicate_kv``: indices the caller frees: its own in ``[0, inserted_len)`` that the tree did
    not take because it already held those tokens with other indices, and those of ragged leaves
    the insert made redundant (their checkpoints moved to the node that now holds their tokens).
    ``node``: the node holding position ``inserted_len`` at its end, or (a ragged end that an
    existing node already covers) inside its span; root when 0."""

    prefix_len: int
    inserted_len: int
    duplicate_kv: list[int]
    node: Node
