"""Keys of the objects the lower tiers hold: content-addressed, with the format in the key.

A lower-tier object is found by the tokens it belongs to, never by a tree node or a slot: a
server that restarted, or another instance sharing the Mooncake store, finds the same objects by
hashing the same tokens. Two kinds of object:

* a **KV block**: the MLA KV of the ``block`` tokens ``[k*block, (k+1)*block)`` (all MLA layers),
  keyed by the chained hash of tokens ``[0, (k+1)*block)``. KV of a token depends on every token
  before it, so the whole prefix is in the hash (SGLang's HiCache chains its page hashes the same
  way, ``mem_cache/utils.py::get_hash_str``);
* a **boundary**: the KDA state after ``pos`` tokens plus the KV of the tokens past the last whole
  block, ``[block * (pos // block), pos)``, keyed by the chained hash of ``[0, pos)``. A state may
  sit at any position (prompt and generation ends are wherever the text ends), so the hash of a
  boundary is the hash of its last whole block extended by the tail tokens.

Mooncake objects are immutable and a put on an existing key succeeds without writing, so
everything that decides how the bytes are read is part of the key (:class:`Namespace`): the
model's and the tokenizer's fingerprints, the layouts and dtypes of KV and state, and the TP rank
and size, and the object format's version (:data:`sglang_k3.tiers.codec.VERSION`). Torch-free.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from sglang_k3.tiers import codec

# Tokens of KV in one block object. 256: a whole number of pages at every page size k3 serves
# (1 to 256), and large enough that an object's bookkeeping on the host (keys, header, one copy
# call: about 15 us) is small beside its time on the link (2 MB at Kimi-Linear-48B sizes: 37 us
# at 55 GB/s). At 64 tokens an object's bookkeeping took longer than its bytes, and the tier moves
# were bound by it (benchmarks/GPU_NOTES.md). LMCache's default chunk is 256 tokens too. A boundary
# object carries the KV past its last whole block, up to 255 tokens.
BLOCK_TOKENS = 256


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides what an object's bytes mean."""

    model: str  # fingerprint of the model and its weights
    tokenizer: str  # fingerprint of the tokenizer
    layout: str  # KV and state layouts and dtypes (e.g. "kv=bf16x4x576;state=int8:...")
    tp_rank: int = 0
    tp_size: int = 1

    @cached_property  # every key starts with it: hashed once, not once per key
    def prefix(self) -> str:
        raw = f"{self.model}|{self.tokenizer}|{self.layout}|{self.tp_rank}/{self.tp_size}"
        return f"k3t{codec.VERSION}-" + hashlib.sha256(raw.encode()).hexdigest()[:24]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def block_hashes(tokens: Sequence[int], upto: int, block: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained hashes of the whole blocks of ``tokens[:upto]``: entry k covers ``[0, (k+1)*block)``
    (``sha256(hash k-1 + block k's tokens as int64)``)."""
    return extend_block_hashes(tokens, [], upto, block)


def extend_block_hashes(
    tokens: Sequence[int], hashes: list[bytes], upto: int, block: int = BLOCK_TOKENS
) -> list[bytes]:
    """:func:`block_hashes` of ``tokens[:upto]``, given the first ``len(hashes)`` of them (appended
    to ``hashes``, which is returned). The new blocks' tokens are converted once, not once per
    block."""
    k0, n = len(hashes), min(upto, len(tokens)) // block
    raw = memoryview(_token_bytes(tokens[k0 * block : n * block]))
    step = 8 * block  # 8 bytes a token (array "q")
    prev = hashes[-1] if hashes else b""
    for k in range(n - k0):
        h = hashlib.sha256(prev)
        h.update(raw[k * step : (k + 1) * step])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def kv_block_key(ns: Namespace, chained: bytes) -> str:
    return f"{ns.prefix}:kv:{chained.hex()}"


def boundary_key(
    ns: Namespace, tokens: Sequence[int], pos: int, hashes: Sequence[bytes], block: int = BLOCK_TOKENS
) -> str:
    """Key of the boundary after ``pos`` tokens; ``hashes`` are :func:`block_hashes` of the
    same tokens, covering at least the whole blocks below ``pos``: the chained hash of the last
    whole block extended by the tokens past it (:func:`boundary_keys` of one position)."""
    return boundary_keys(ns, tokens, [pos], hashes, block)[0]


def boundary_keys(
    ns: Namespace, tokens: Sequence[int], positions: Sequence[int], hashes: Sequence[bytes], block: int = BLOCK_TOKENS
) -> list[str]:
    """The boundary keys of ``positions``, all in one block (the same ``p // block``): the
    block's tokens are hashed once, not once per position (a lookup asks up to a block's worth
    of positions)."""
    if not positions:
        return []
    k = positions[0] // block
    if any(p // block != k for p in positions):
        raise ValueError("boundary_keys takes positions inside one block")
    h = hashlib.sha256(b"tail" + (hashes[k - 1] if k else b""))
    keys: dict[int, str] = {}
    lo = done = k * block
    raw = memoryview(_token_bytes(tokens[lo : max(positions)]))
    for p in sorted(positions):
        h.update(raw[(done - lo) * 8 : (p - lo) * 8])  # 8 bytes a token (array "q")
        done = p
        keys[p] = f"{ns.prefix}:st:{p}:{h.copy().hexdigest()}"
    return [keys[p] for p in positions]


def file_fingerprint(directory: str, names: Sequence[str], sample: int = 1 << 20) -> str:
    """A fingerprint of the files ``names`` in ``directory`` that exist: their names, sizes and
    the first and last ``sample`` bytes of each (weights are large; a changed weight file changes
    its head or tail or its size in every format we read). Empty when none exists."""
    h = hashlib.sha256()
    found = False
    for name in sorted(names):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        found = True
        size = os.path.getsize(path)
        h.update(f"{name}:{size}:".encode())
        with open(path, "rb") as f:
            h.update(f.read(sample))
            if size > 2 * sample:
                f.seek(size - sample)
                h.update(f.read(sample))
    return h.hexdigest()[:32] if found else ""


def model_fingerprint(model_dir: str) -> str:
    """The model's config and weight files (``*.safetensors``, ``*.bin``)."""
    if not os.path.isdir(model_dir):
        return hashlib.sha256(model_dir.encode()).hexdigest()[:32]  # a hub id: its name is all we have
    weights = [n for n in os.listdir(model_dir) if n.endswith((".safetensors", ".bin", ".json"))]
    return file_fingerprint(model_dir, [n for n in weights if not n.startswith("tokenizer")])


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    names = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model"]
    if not os.path.isdir(tokenizer_dir):
        return hashlib.sha256(tokenizer_dir.encode()).hexdigest()[:32]
    return file_fingerprint(tokenizer_dir, names + [n for n in os.listdir(tokenizer_dir) if n.endswith(".tiktoken")])
