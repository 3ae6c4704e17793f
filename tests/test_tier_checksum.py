"""``k3sum64``, the tier objects' checksum: what it catches (numpy reference), and the Triton
kernel equal to the reference bit for bit (in Triton's CPU interpreter here, on CUDA where
there is one), over pieces at any byte offset, empty ones and ones spanning many chunks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from sglang_k3.kernels.tier import device_checksums, k3sum64

SEED = 20261206


def _bytes(n: int, seed: int = SEED) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_every_single_bit_flip_is_caught():
    data = _bytes(4099)  # not a whole number of words
    base = k3sum64(data)
    rng = np.random.default_rng(SEED)
    for pos in [0, 1, 4095, 4096, 4098, *rng.integers(0, len(data), 300).tolist()]:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        assert k3sum64(bad) != base, pos


def test_moved_words_and_lengths_are_caught():
    data = bytearray(_bytes(1024))
    base = k3sum64(data)
    swapped = bytearray(data)
    swapped[0:4], swapped[40:44] = data[40:44], data[0:4]
    assert data[0:4] != data[40:44] and k3sum64(swapped) != base
    assert k3sum64(data[4:] + data[:4]) != base  # rotated by a word
    assert k3sum64(data + b"\0") != base  # a trailing zero byte: the length is in the checksum
    assert k3sum64(data[:-1]) != base
    assert k3sum64(b"") == 0 and k3sum64(b"\0") != 0
    # every piece of the same bytes gives the same answer whatever buffer type holds it
    assert k3sum64(memoryview(np.frombuffer(bytes(data), dtype=np.uint8))) == base == k3sum64(bytes(data))


def test_cpu_pieces_equal_the_reference():
    data = _bytes(70_003)
    offs, sizes = [0, 3, 10_001, 10_001, 40_000], [3, 9_998, 0, 29_999, 30_003]
    got = device_checksums(torch.frombuffer(bytearray(data), dtype=torch.uint8), offs, sizes)()
    assert got == [k3sum64(data[o : o + n]) for o, n in zip(offs, sizes)]


_INTERP = textwrap.dedent(
    r"""
    import numpy as np, torch
    from sglang_k3.kernels.tier import triton_kernels as tk
    from sglang_k3.kernels.tier.reference import k3sum64, finish
    data = np.random.default_rng(SEED).integers(0, 256, 200_000, dtype=np.uint8)
    offs = [0, 5, 70_001, 70_001, 100_003, 199_999]
    sizes = [5, 69_996, 0, 30_002, 65_540, 1]
    chunk = 4096  # words: the large pieces span several programs
    table, starts = tk.chunk_table(offs, sizes, chunk)
    n = table.size // 3
    out = torch.empty(n, dtype=torch.int64)
    tk._k3sum_chunks[(n,)](torch.from_numpy(data), torch.from_numpy(table), out, n, CHUNK_W=chunk, BLOCK_W=1024)
    sums = np.add.reduceat(out.numpy().view(np.uint64), starts)
    got = [finish(int(s), int(n)) for s, n in zip(sums, sizes)]
    want = [k3sum64(data[o : o + n].tobytes()) for o, n in zip(offs, sizes)]
    assert got == want, (got, want)
    print("INTERP_OK")
    """
).replace("SEED", str(SEED))


def test_triton_kernel_equals_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERP], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "INTERP_OK" in r.stdout, r.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_equals_reference():
    data = _bytes(3_000_017)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    offs, sizes = [0, 1, 1_000_003, 1_000_003, 2_000_000], [1, 1_000_000, 0, 999_997, 1_000_017]
    got = device_checksums(src, offs, sizes)()
    assert got == [k3sum64(data[o : o + n]) for o, n in zip(offs, sizes)]
