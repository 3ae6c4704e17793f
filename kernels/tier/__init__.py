"""The tier objects' checksum (``k3sum64``): a Triton kernel on CUDA, the numpy reference elsewhere.

A tier object is checked end to end: its checksum is computed where its bytes are (on the device,
over the same staging tensor the copy down reads) before they cross the host link, and verified
on the device again after a load's copy up, before any byte is written into the pools. The host
never walks the payload, so the moves run at the link's rate (``benchmarks/GPU_NOTES.md``). The
function is defined byte for byte in :mod:`.reference`, which any reader without a GPU uses; the
kernel equals it bit for bit (``tests/test_tier_checksum.py``).

* :func:`reference.k3sum64` one buffer on the host (numpy; torch-free, the tier codec imports it);
* :func:`device_checksums` consecutive pieces of one uint8 tensor, one launch for all of them.
"""

from __future__ import annotations

from typing import Sequence

from .reference import finish, k3sum64  # noqa: F401  (re-exported)


def device_checksums(src, offsets: Sequence[int], sizes: Sequence[int], after=None):
    """Start the checksums of ``src[off : off + n]`` for each piece, ``src`` a 1-D uint8 tensor.
    Returns a callable that gives the list of checksums; on CUDA one kernel runs now, on the
    current stream (after the CUDA event ``after``, if given), and the callable synchronizes
    only on its small result. Elsewhere the reference runs when the callable is called (so a
    writer thread, not the caller, pays it)."""
    if src.is_cuda:
        from . import triton_kernels

        return triton_kernels.k3sum64_pieces(src, offsets, sizes, after)
    host = src.detach().cpu()

    def result() -> list[int]:
        arr = host.numpy()
        return [k3sum64(memoryview(arr[o : o + n])) for o, n in zip(offsets, sizes)]

    return result
