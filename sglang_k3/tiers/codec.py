"""The bytes of one lower-tier object: a fixed header, then the payload.

An object read back from a tier is trusted only after :func:`decode` checks it: the magic and
version, that it was written for this very key (the header carries a digest of the key, so an
object copied or written under another key, another model's or tokenizer's included, is
refused), the lengths, and a CRC-32 of the payload (zlib's, several GB/s; it catches corruption
and truncation, the key digest catches misplacement; Mooncake's own optional check is a CRC-64). A failure raises
:class:`InvalidObject`; the tier manager counts and logs it and treats the lookup as a miss.
Torch-free.

Layout (little-endian)::

    magic  4s   b"K3T1"
    ver    H    1
    kind   B    1 = KV block, 2 = boundary (state + tail KV)
    ckind  B    the checkpoint's kind flags (boundary), 0 otherwise
    pos    Q    tokens before the boundary (boundary) / end of the block (KV block)
    state  Q    bytes of state at the payload's start (0 for a KV block)
    kv     Q    bytes of KV after it
    tokens I    tokens of KV in it
    keydig 16s  BLAKE2b-128 of the key
    crc    I    CRC-32 of the payload
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import Union

MAGIC = b"K3T1"
VERSION = 1
KV_BLOCK = 1
BOUNDARY = 2
_HEADER = struct.Struct("<4sHBBQQQI16sI")
Bytes = Union[bytes, memoryview]
HEADER_BYTES = _HEADER.size


class InvalidObject(ValueError):
    """An object that fails validation: never restored."""


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class Decoded:
    """A checked object; ``state`` and ``kv`` are views into the blob (no copy)."""

    kind: int
    checkpoint_kind: int
    pos: int
    state: memoryview
    kv: memoryview
    kv_tokens: int


def encode(key: str, kind: int, pos: int, state: Bytes, kv: Bytes, kv_tokens: int, checkpoint_kind: int = 0) -> bytes:
    crc = zlib.crc32(kv, zlib.crc32(state))
    head = _HEADER.pack(
        MAGIC, VERSION, kind, checkpoint_kind, pos, len(state), len(kv), kv_tokens, _digest(key.encode()), crc
    )
    return b"".join((head, state, kv))


def peek(blob: bytes) -> tuple[int, int, int]:
    """``(kind, state bytes, KV tokens)`` from the header, unchecked (for accounting only)."""
    _, _, kind, _, _, n_state, _, n_tok, _, _ = _HEADER.unpack_from(blob)
    return kind, n_state, n_tok


def decode(key: str, blob: bytes, kv_token_bytes: int, state_bytes: int) -> Decoded:
    """Check ``blob`` against ``key`` and the sizes this server reads; raise InvalidObject."""
    if len(blob) < HEADER_BYTES:
        raise InvalidObject(f"{len(blob)} bytes: shorter than the header")
    magic, ver, kind, ckind, pos, n_state, n_kv, n_tok, keydig, check = _HEADER.unpack_from(blob)
    if magic != MAGIC or ver != VERSION:
        raise InvalidObject(f"magic/version {magic!r}/{ver}")
    if keydig != _digest(key.encode()):
        raise InvalidObject("written under another key")
    if len(blob) != HEADER_BYTES + n_state + n_kv:
        raise InvalidObject(f"{len(blob)} bytes, header says {HEADER_BYTES + n_state + n_kv}")
    if kind not in (KV_BLOCK, BOUNDARY) or n_kv != n_tok * kv_token_bytes:
        raise InvalidObject(f"kind {kind}, {n_kv} KV bytes for {n_tok} tokens")
    if n_state != (state_bytes if kind == BOUNDARY else 0):
        raise InvalidObject(f"{n_state} state bytes, this server's state is {state_bytes}")
    payload = memoryview(blob)[HEADER_BYTES:]
    if zlib.crc32(payload) != check:
        raise InvalidObject("checksum mismatch")
    return Decoded(kind, ckind, pos, payload[:n_state], payload[n_state:], n_tok)
