"""Fault injection for the noise-aware differential's own test: a restore that is really wrong.

Only active in a process started with this folder first on ``PYTHONPATH`` and
``SGLANG_K3_TEST_CORRUPT_RESTORE=N`` set (``benchmarks.noise_differential --corrupt`` does both for
one extra k3 server). Python imports ``sitecustomize`` at start-up in every interpreter, so the
scheduler subprocesses SGLang spawns get it too. It wraps both restore paths of the checkpoint
stores and corrupts the N-th state restored in that process: the state keeps its shape, scale and
location and gets the wrong content (its recurrent state negated), as a bad kernel or a stale slot
would leave it.

* int8/bf16 (``QuantizedStore``): every hit is dequantized by ``CheckpointPool.restore``; the
  wrapper negates the active slot it has just written.
* fp32 (``NativeSlotStore``): SGLang copies the checkpoint slot into the request's slot at its
  next forward (``mamba_cow_src_index``); the wrapper negates the checkpoint slot before that copy.

Nothing in ``sglang_k3`` knows about this file.
"""

import os
import sys

_N = os.environ.get("SGLANG_K3_TEST_CORRUPT_RESTORE")
if _N:
    _target = int(_N)
    if _target < 1:
        raise SystemExit("SGLANG_K3_TEST_CORRUPT_RESTORE must be >= 1")
    from sglang_k3.state import checkpoint_pool as _cp
    from sglang_k3.state import checkpoint_store as _cs

    _seen = [0]

    def _hit(count: int):
        """Index (0-based) of the target among the next ``count`` restores, or None."""
        before = _seen[0]
        _seen[0] += count
        return _target - before - 1 if before < _target <= _seen[0] else None

    def _say(what: str) -> None:
        print(f"[fault injection] negated {what}", file=sys.stderr, flush=True)

    _real_pool_restore = _cp.CheckpointPool.restore

    def _pool_restore(self, ckpt_slots, active_slots, *, temporal=None, conv=None):
        _real_pool_restore(self, ckpt_slots, active_slots, temporal=temporal, conv=conv)
        active_slots = list(active_slots)
        i = _hit(len(active_slots))
        if i is not None:
            t, _c = self._active(temporal, conv)
            t[:, active_slots[i]].neg_()
            _say(f"the recurrent state dequantized into active slot {active_slots[i]}")

    _real_native_restore = _cs.NativeSlotStore.restore

    def _native_restore(self, handle, rid, active_slot):
        src = _real_native_restore(self, handle, rid, active_slot)
        if src is not None and _hit(1) is not None:
            self.slots.pool.mamba_cache.temporal[:, src].neg_()
            _say(f"fp32 checkpoint slot {src} before SGLang copies it into slot {active_slot}")
        return src

    _cp.CheckpointPool.restore = _pool_restore
    _cs.NativeSlotStore.restore = _native_restore
