"""The bytes of one lower-tier object: a fixed header, then the payload.

An object read back from a tier is trusted only after it is checked: :func:`decode` checks the
magic and version, that it was written for this very key (the header carries a digest of the
key, so an object copied or written under another key, another model's or tokenizer's included,
is refused) and the lengths; the payload's checksum is checked either there (``verify=True``, on
the host) or by the tier IO after it copied the payload up to the device, before any byte of it
is written into the pools (the server's path: :meth:`sglang_k3.tiers.manager.TierManager.load`).
The checksum catches corruption and truncation, the key digest misplacement. A failure raises
:class:`InvalidObject`; the tier manager counts and logs it and treats the lookup as a miss.
Torch-free.

**The checksum is ``k3sum64``** (:mod:`sglang_k3.kernels.tier.reference`, numpy): a sum of the
payload's position-mixed 32-bit words. The tier IO computes it where the bytes are, on the device
before the copy down and after the copy up, so the host never reads a payload and the moves run
at the host link's rate. Format 2 sealed with XXH3-64 on the host: 9.8 GB/s on one core of the
H200's host, which bounded the tier moves at 8-14% of the link (``benchmarks/GPU_NOTES.md``).
Mooncake's own optional check is a CRC-64.

An object is built in place (:func:`new`, then :func:`seal`): the tier IO writes the state and the
KV straight into the blob's payload and returns its checksum, so a save copies each byte once,
from the device into the object. A sealed blob is not written again while a store holds it (the
host store may hand the buffer of one it dropped to a new object:
:meth:`sglang_k3.tiers.host_store.HostStore.blank`).

Layout (little-endian)::

    magic  4s   b"K3T1"
    ver    H    3 (the version is in every key too: :func:`sglang_k3.tiers.keys.Namespace.prefix`)
    kind   B    1 = KV block, 2 = boundary (state + tail KV)
    ckind  B    the checkpoint's kind flags (boundary), 0 otherwise
    pos    Q    tokens before the boundary (boundary) / end of the block (KV block)
    state  Q    bytes of state at the payload's start (0 for a KV block)
    kv     Q    bytes of KV after it
    tokens I    tokens of KV in it
    keydig 16s  BLAKE2b-128 of the key
    check  Q    k3sum64 of the payload
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union

from sglang_k3.kernels.tier.reference import k3sum64

MAGIC = b"K3T1"
VERSION = 3
KV_BLOCK = 1
BOUNDARY = 2
_HEADER = struct.Struct("<4sHBBQQQI16sQ")
Bytes = Union[bytes, bytearray, memoryview]
Buffer = Any  # a writable 1-D byte buffer: a bytearray, or a uint8 numpy array (pinned on CUDA)
HEADER_BYTES = _HEADER.size


class InvalidObject(ValueError):
    """An object that fails validation: never restored."""


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class Decoded:
    """A checked object; ``payload`` (``state`` then ``kv``) is a view into the blob (no copy).
    ``check``: the payload's checksum as written; verified unless :func:`decode` was told not to."""

    kind: int
    checkpoint_kind: int
    pos: int
    payload: memoryview
    state_bytes: int
    kv_tokens: int
    check: int

    @property
    def state(self) -> memoryview:
        return self.payload[: self.state_bytes]

    @property
    def kv(self) -> memoryview:
        return self.payload[self.state_bytes :]


@dataclass(frozen=True)
class Blank:
    """An unsealed object: ``blob`` with room for the header, and views of its payload for the
    tier IO to fill (``state`` first, then ``kv``; ``payload`` is both)."""

    blob: Buffer
    state: memoryview
    kv: memoryview

    @property
    def payload(self) -> memoryview:
        return memoryview(self.blob)[HEADER_BYTES:]


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


def seal(
    blank: Blank, key: str, kind: int, pos: int, kv_tokens: int, checkpoint_kind: int = 0, check: Optional[int] = None
) -> Buffer:
    """Write the header of a filled :class:`Blank`; returns its blob. ``check``: the payload's
    checksum as the tier IO computed it on the device; None computes it here, on the host."""
    n_state, n_kv = len(blank.state), len(blank.kv)
    if check is None:
        check = k3sum64(blank.payload)
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


def decode(key: str, blob: bytes, kv_token_bytes: int, state_bytes: int, verify: bool = True) -> Decoded:
    """Check ``blob`` against ``key`` and the sizes this server reads; raise InvalidObject.
    ``verify=False`` leaves the payload's checksum to the caller (``Decoded.check``): the tier
    IO verifies it on the device, after the copy up and before the bytes are used."""
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
    if verify and k3sum64(payload) != check:
        raise InvalidObject("checksum mismatch")
    return Decoded(kind, ckind, pos, payload, n_state, n_tok, check)
