"""Fault injection and state probes for the noise-aware differential (``benchmarks.noise_differential``).

Only active in a process started with this folder first on ``PYTHONPATH`` and one of the variables
below set (the harness does both for the servers it starts). Python imports ``sitecustomize`` at
start-up in every interpreter, so the scheduler subprocesses SGLang spawns get it too.

``SGLANG_K3_TEST_CORRUPT_RESTORE=N``: a restore that is really wrong. It wraps both restore paths of
the checkpoint stores and corrupts the N-th state restored in that process: the state keeps its
shape, scale and location and gets the wrong content (its recurrent state negated), as a bad kernel
or a stale slot would leave it.

* int8/bf16 (``QuantizedStore``): every hit is dequantized by ``CheckpointPool.restore``; the
  wrapper negates the active slot it has just written.
* fp32 (``NativeSlotStore``): SGLang copies the checkpoint slot into the request's slot at its
  next forward (``mamba_cow_src_index``); the wrapper negates the checkpoint slot before that copy.

``SGLANG_K3_TEST_STATE_DIR=DIR``: state probes, so the harness can compare states, not only outputs.

* Every state a k3 server restores, as the request will use it (after a corruption above), is
  written to ``DIR/restore-NNNNN.pt`` (``{"temporal": [L, H, V, K], "conv": [[L, ...], ...]}`` on the
  host, in the pool's dtype), numbered in the order restored.
* Any server (k3 or cache off): the state of a request whose ``rid`` starts with ``k3state-`` is
  written to ``DIR/final-RID.pt`` when SGLang releases it. Sent with ``max_new_tokens`` 0 (prefill
  only, as the harness sends it), that is the state after exactly its prompt, with no decode step.

Nothing in ``sglang_k3`` knows about this file.
"""

import os
import sys

_N = os.environ.get("SGLANG_K3_TEST_CORRUPT_RESTORE")
_DIR = os.environ.get("SGLANG_K3_TEST_STATE_DIR")
PROBE_PREFIX = "k3state-"

if _N or _DIR:
    _target = int(_N) if _N else None
    if _target is not None and _target < 1:
        raise SystemExit("SGLANG_K3_TEST_CORRUPT_RESTORE must be >= 1")
    if _DIR:
        os.makedirs(_DIR, exist_ok=True)
    import torch

    from sglang_k3.state import checkpoint_pool as _cp
    from sglang_k3.state import checkpoint_store as _cs

    _seen = [0]
    _dumped = [0]

    def _hit(count: int):
        """Index (0-based) of the corruption's target among the next ``count`` restores, or None."""
        before = _seen[0]
        _seen[0] += count
        if _target is None:
            return None
        return _target - before - 1 if before < _target <= _seen[0] else None

    def _say(what: str) -> None:
        print(f"[fault injection] negated {what}", file=sys.stderr, flush=True)

    def _slot(temporal, conv, slot: int) -> dict:
        convs = conv if isinstance(conv, (list, tuple)) else ([conv] if conv is not None else [])
        return {
            "temporal": temporal[:, slot].detach().cpu().clone(),
            "conv": [c[:, slot].detach().cpu().clone() for c in convs],
        }

    def _write(name: str, state: dict) -> None:
        path = os.path.join(_DIR, name)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees half a file

    def _dump_restore(temporal, conv, slot: int) -> None:
        if _DIR:
            _dumped[0] += 1
            _write(f"restore-{_dumped[0]:05d}.pt", _slot(temporal, conv, slot))

    _real_pool_restore = _cp.CheckpointPool.restore

    def _pool_restore(self, ckpt_slots, active_slots, *, temporal=None, conv=None):
        _real_pool_restore(self, ckpt_slots, active_slots, temporal=temporal, conv=conv)
        active_slots = list(active_slots)
        t, c = self._active(temporal, conv)
        i = _hit(len(active_slots))
        if i is not None:
            t[:, active_slots[i]].neg_()
            _say(f"the recurrent state dequantized into active slot {active_slots[i]}")
        for s in active_slots:
            _dump_restore(t, c, s)

    _real_native_restore = _cs.NativeSlotStore.restore

    def _native_restore(self, handle, rid, active_slot):
        src = _real_native_restore(self, handle, rid, active_slot)
        if src is not None:
            cache = self.slots.pool.mamba_cache
            if _hit(1) is not None:
                cache.temporal[:, src].neg_()
                _say(f"fp32 checkpoint slot {src} before SGLang copies it into slot {active_slot}")
            _dump_restore(cache.temporal, cache.conv, src)
        return src

    _cp.CheckpointPool.restore = _pool_restore
    _cs.NativeSlotStore.restore = _native_restore

    if _DIR:
        # patched before the scheduler imports it by name (sitecustomize runs first)
        from sglang.srt.mem_cache import common as _common

        _real_release = _common.release_kv_cache

        def _release(req, tree_cache, *, checkpoint):
            rid = str(getattr(req, "rid", ""))
            idx = getattr(req.kv, "mamba_pool_idx", None)
            if rid.startswith(PROBE_PREFIX) and idx is not None:
                cache = tree_cache.req_to_token_pool.mamba_pool.mamba_cache
                _write(f"final-{rid}.pt", _slot(cache.temporal, cache.conv, int(idx)))
            return _real_release(req, tree_cache, checkpoint=checkpoint)

        _common.release_kv_cache = _release
