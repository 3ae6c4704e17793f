"""Deferred, batched restores of quantized checkpoints (``sglang_k3/state/deferred_restore.py``),
against a real CheckpointPool on CPU: a flush writes exactly what eager restores write, in one call,
and dropped or replaced entries are not restored."""

from __future__ import annotations

import pytest
import torch

from sglang_k3.state.checkpoint_pool import CheckpointError, CheckpointPool
from sglang_k3.state.deferred_restore import DeferredRestores

L, S, H, V, K = 3, 8, 2, 16, 16


def _pool(seed: int):
    g = torch.Generator().manual_seed(seed)
    temporal = torch.randn(L, S, H, V, K, generator=g)
    conv = torch.randn(L, S, 3, 24, generator=g).bfloat16()
    pool = CheckpointPool.from_active(temporal, conv, num_slots=6, dtype="int8")
    slots = pool.alloc(3)
    assert pool.store([0, 1, 2], slots).all_ok
    return pool, slots, temporal, conv


def test_flush_equals_eager_restores_and_drops_what_was_dropped():
    eager, slots, t_eager, c_eager = _pool(5)
    eager.restore([slots[0], slots[2]], [5, 6])

    pool, slots2, t, c = _pool(5)
    before = t.clone()
    d = DeferredRestores()
    d.bind(pool)
    d.add("a", slots2[1], 5)
    d.add("a", slots2[0], 5)  # a re-match replaces the request's entry
    d.add("b", slots2[2], 6)
    d.add("c", slots2[1], 7)
    assert d.drop("c") == (slots2[1], 7)  # released before its forward: not restored
    assert len(d) == 2
    assert torch.equal(t, before)  # nothing written before the flush
    assert d.flush() == 2 and len(d) == 0 and d.flushes == 1 and d.restored == 2
    assert torch.equal(t, t_eager) and torch.equal(c, c_eager)
    assert torch.equal(t[:, 7], before[:, 7])
    assert d.flush() == 0 and d.flushes == 1


def test_add_needs_a_bound_pool_and_flush_checks_slots():
    d = DeferredRestores()
    with pytest.raises(RuntimeError):
        d.add("a", 0, 1)
    pool, slots, _, _ = _pool(6)
    d.bind(pool)
    d.add("a", slots[0], 4)
    pool.decref([slots[0]])  # freed (e.g. evicted) although a restore still named it
    with pytest.raises(CheckpointError):
        d.flush()
