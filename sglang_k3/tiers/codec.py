"""The bytes of one lower-tier object: a fixed header, then the payload.

An object read back from a tier is trusted only after :func:`decode` checks it: the magic and
version, that it was written for this very key (the header carries a digest of the key, so an
object copied or written under another key, another model's or tokenizer's included, is
refused), the lengths, and an XXH3-64 of the payload (it catches corruption and truncation, the
key digest catches misplacement; Mooncake's own optional check is a CRC-64). XXH3-64 runs at 13-17
GB/s on one core of this project's CPU machine and 9.8 GB/s on the H200's host, zlib's CRC-32 at
about 2 (format version 1 used CRC-32; ``benchmarks/GPU_NOTES.md`` has the tier moves it
bounded). ``xxhash`` is a dependency of SGLang itself. A failure raises :class:`InvalidObject`;
the tier manager counts and logs it and treats the lookup as a miss. Torch-free.

An object is built in place (:func:`new`, then :func:`seal`): the tier IO writes the state and the
KV straight into the blob's payload, so a save copies each byte once, from the device into the
object. A sealed blob is not written again while a store holds it (the host store may hand the
buffer of one it dropped to a new object: :meth:`sglang_k3.tiers.host_store.HostStore.blank`).

Layout (little-endian)::

    magic  4s   b"K3T1"
    ver    H    2 (the version is in every key too: :func:`sglang_k3.tiers.keys.Namespace.prefix`)
    kind   B    1 = KV block, 2 = boundary (state + tail KV)
    ckind  B    the checkpoint's kind flags (boundary), 0 otherwise
    pos    Q    tokens before the boundary (boundary) / end of the block (KV block)
    state  Q    bytes of state at the payload's start (0 for a KV block)
    kv     Q    bytes of KV after it
    tokens I    tokens of KV in it
    keydig 16s  BLAKE2b-128 of the key
    check  Q    XXH3-64 of the payload
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union

import xxhash

MAGIC = b"K3T1"
VERSION = 2
KV_BLOCK = 1
BOUNDARY = 2
_HEADER = struct.Struct("<4sHBBQQQI16sQ")
Bytes = Union[bytes, bytearray, memoryview]
Buffer = Any  # a writable 1-D byte buffer: a bytearray, or a uint8 numpy array (pinned on CUDA)
HEADER_BYTES = _HEADER.size


def _check(payload: Bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


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


@dataclass(frozen=True)
class Blank:
    """An unsealed object: ``blob`` with room for the header, and views of its payload for the
    tier IO to fill (``state`` first, then ``kv``)."""

    blob: Buffer
    state: memoryview
    kv: memoryview


def new(state_bytes: int, kv_bytes: int, buf: Optional[Buffer] = None) -> Blank:
    """Room for an object; ``buf``: a writable buffer of exactly that size to build it in (a
    spare, or pinned memory; every byte of it is written before :func:`seal` returns, by the IO
    and the header)."""
    n = HEADER_BYTES + state_bytes + kv_bytes
    if buf is not None and len(buf) != n:
        raise ValueError(f"a spare of {len(buf)} bytes for an object of {n}")
    blob = bytearray(n) if buf is None else buf
    view = memoryview(blob)
    mid = HEADER_BYTES + state_bytes
    return Blank(blob, view[HEADER_BYTES:mid], view[mid:])


def seal(blank: Blank, key: str, kind: int, pos: int, kv_tokens: int, checkpoint_kind: int = 0) -> Buffer:
    """Write the header of a filled :class:`Blank`; returns its blob."""
    n_state, n_kv = len(blank.state), len(blank.kv)
    check = _check(memoryview(blank.blob)[HEADER_BYTES:])
    digest = _digest(key.encode())
    fields = (MAGIC, VERSION, kind, checkpoint_kind, pos, n_state, n_kv, kv_tokens, digest, check)
    _HEADER.pack_into(blank.blob, 0, *fields)
    return blank.blob


def encode(
    key: str, kind: int, pos: int, state: Bytes, kv: Bytes, kv_tokens: int, checkpoint_kind: int = 0
) -> bytearray:
    """An object from payload bytes already in host memory (:func:`new` + :func:`seal`)."""
    blank = new(len(state), len(kv))
    blank.state[:] = state
    blank.kv[:] = kv
    return seal(blank, key, kind, pos, kv_tokens, checkpoint_kind)


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
    if _check(payload) != check:
        raise InvalidObject("checksum mismatch")
    return Decoded(kind, ckind, pos, payload[:n_state], payload[n_state:], n_tok)
