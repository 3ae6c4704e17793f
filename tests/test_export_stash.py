"""The export stash keeps only the chunk-boundary rows the cache may store.

Real tensors shaped like the KDA extend's exports (``h [1, NT, H, V, K]``, the pre-conv stream
``mixed_qkv [T, D]``), the cache's own candidate rule (``PlacementPolicy.export_candidates``) as
the planner, and for the stores a real SGLang ``HybridReqToTokenPool`` on CPU with the project's
``NativeSlotStore`` / ``QuantizedStore``, compared with a store from the full tensors (what the
stash did before it kept only candidates).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from sglang_k3.cache import PlacementPolicy
from sglang_k3.state.deferred_restore import DeferredRestores
from sglang_k3.state.export_stash import CHUNK, ExportStash, ExportView
from sglang_k3.state.forward_state import ForwardState

H, V, KD = 2, 16, 16  # heads, value and key dims of one KDA state
WIDTH = 3  # conv kernel 4: the conv state is the 3 pre-conv rows before a boundary
D = 3 * H * KD  # q, k, v channels of the pre-conv stream
LAYERS = [0, 2, 3]  # model layer ids of the KDA layers

# One extend forward: (rid, slot, prefix, extend length, prompt length, branch point or None).
# "a" reaches its prompt end, with a branch point at 150; "b" is a middle prefill chunk (does not
# reach its prompt end) with a branch point at 200; "c" is shorter than a chunk (no grid point);
# "d" reaches its prompt end, no branch point; slot -1 is a padded row.
BATCH = [
    ("a", 5, 0, 300, 300, 150),
    ("b", 2, 128, 200, 1000, 200),
    ("c", 7, 0, 50, 50, None),
    ("pad", -1, 0, 70, 70, None),
    ("d", 4, 64, 140, 204, None),
]
# The candidates that rule gives: a: 256 (prompt end) and 128 (branch); b: 192 (branch); d: 192.
PLANNED = {("a", 128), ("a", 256), ("b", 192), ("d", 192)}


def _planner(policy: PlacementPolicy):
    prompt = {rid: p for rid, _, _, _, p, _ in BATCH}
    branch = {rid: bp for rid, _, _, _, _, bp in BATCH if bp is not None}
    return lambda rid, seq: list(policy.export_candidates(seq.grid(), seq.end, prompt.get(rid), branch.get(rid)))


def _exports(seed: int, h_dtype=torch.float32, conv_dtype=torch.bfloat16):
    """One layer's extend exports for BATCH: h over the packed chunk axis, mixed_qkv over rows."""
    g = torch.Generator().manual_seed(seed)
    T = sum(n for _, _, _, n, _, _ in BATCH)
    NT = sum(-(-n // CHUNK) for _, _, _, n, _, _ in BATCH)
    h = torch.randn(1, NT, H, V, KD, generator=g).to(h_dtype)
    mixed_qkv = torch.randn(T, D, generator=g).to(conv_dtype)
    return h, mixed_qkv


def _begin(stash: ExportStash, batch_key: int, layer_id: int, rids=True) -> None:
    """What the backend hook does at each KDA layer: begin only when a new forward starts."""
    if stash.starts_forward(batch_key, layer_id):
        stash.begin(
            batch_key,
            [s for _, s, _, _, _, _ in BATCH],
            [p for _, _, p, _, _, _ in BATCH],
            [n for _, _, _, n, _, _ in BATCH],
            rids=[r for r, *_ in BATCH] if rids else None,
        )


def _where(rid: str, pos: int) -> tuple[int, int]:
    """(index into h's flattened chunk axis, row just past the boundary in mixed_qkv)."""
    row = chunk = 0
    for r, _, pre, n, _, _ in BATCH:
        if r == rid:
            return chunk + (pos - pre) // CHUNK, row + pos - pre
        row += n
        chunk += -(-n // CHUNK)
    raise KeyError(rid)


def _slot(rid: str) -> int:
    return next(s for r, s, *_ in BATCH if r == rid)


def _row_bytes(h_dtype=torch.float32, conv_dtype=torch.bfloat16) -> int:
    return H * V * KD * h_dtype.itemsize + WIDTH * D * conv_dtype.itemsize


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])  # CPU kernel fp32, fla bf16
def test_keeps_only_planned_rows_as_copies(h_dtype):
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=len(LAYERS))
    full = {}
    refs = []
    for i, layer in enumerate(LAYERS):
        _begin(stash, 1, layer)
        h, mixed_qkv = _exports(i, h_dtype)
        full[layer] = (h.clone(), mixed_qkv.clone())
        stash.record_layer(layer, h, mixed_qkv)
        refs += [weakref.ref(h), weakref.ref(mixed_qkv)]
        del h, mixed_qkv
    gc.collect()
    assert all(r() is None for r in refs), "the stash still references a full exported tensor"
    assert sorted(stash.layers) == LAYERS

    kept = set()
    for rid, slot, pre, n, _, _ in BATCH:
        seq = stash.lookup(slot, pre + n) if slot >= 0 else None
        for pos in seq.grid() if seq else []:
            j = stash.row(seq, pos)
            if (rid, pos) not in PLANNED:
                assert j is None, (rid, pos)
                continue
            kept.add((rid, pos))
            chunk, end = _where(rid, pos)
            for layer in LAYERS:
                h, mixed_qkv = full[layer]
                rows = stash.layers[layer]
                assert torch.equal(rows.h[j], h[0, chunk])
                assert torch.equal(rows.conv[j], mixed_qkv[end - WIDTH : end])
    assert kept == PLANNED

    # Held: exactly the planned rows, at most 2 per sequence per layer, far below the full tensors.
    per_row = _row_bytes(h_dtype)
    assert stash.stash_bytes() == len(PLANNED) * len(LAYERS) * per_row
    n_seqs = sum(1 for _, s, *_ in BATCH if s >= 0)
    assert stash.stash_bytes() <= 2 * n_seqs * len(LAYERS) * per_row
    full_bytes = sum(h.numel() * h.element_size() + m.numel() * m.element_size() for h, m in full.values())
    assert stash.peak_exported_bytes == full_bytes
    assert stash.peak_bytes == stash.stash_bytes() < full_bytes / 3
    stack = stash.stacked()  # one copy for all layers, not views of the exports
    assert stack.h.untyped_storage().nbytes() == stack.h.numel() * stack.h.element_size()
    assert stack.conv.untyped_storage().nbytes() == stack.conv.numel() * stack.conv.element_size()


def test_placement_flags_shape_the_plan():
    """No branch-point candidates with branch points off; no prompt-end ones with that off."""
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy(at_branch_points=False)), conv_width=WIDTH, num_layers=1)
    _begin(stash, 1, 0)
    stash.record_layer(0, *_exports(0))
    assert set(stash._rows) == {(_slot("a"), 256), (_slot("d"), 192)}
    stash.enable(_planner(PlacementPolicy(at_prompt_end=False)), conv_width=WIDTH, num_layers=1)
    _begin(stash, 2, 0)
    stash.record_layer(0, *_exports(0))
    assert set(stash._rows) == {(_slot("a"), 128), (_slot("b"), 192)}


def test_unplanned_stale_and_incomplete_lookups_give_nothing():
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=1)
    _begin(stash, 1, 0)
    stash.record_layer(0, *_exports(0))
    a = stash.lookup(_slot("a"), 300)
    assert a is not None and stash.row(a, 128) is not None
    assert stash.lookup(_slot("a"), 299) is None  # not the extent this forward computed
    assert stash.lookup(_slot("c"), 50) is not None and stash.lookup(_slot("c"), 50).grid() == []
    assert stash.row(a, 64) is None and stash.row(a, 192) is None  # exported, not planned

    # A new forward (same slots, same extents) clears everything of the previous one.
    _begin(stash, 2, 0)
    assert stash.stash_bytes() == 0 and stash.layers == {}
    assert stash.row(a, 128) is None  # the previous forward's sequence
    a2 = stash.lookup(_slot("a"), 300)
    assert a2 is None  # no layer recorded yet
    stash.record_layer(0, *_exports(1))
    a2 = stash.lookup(_slot("a"), 300)
    assert a2 is not a and stash.row(a2, 128) is not None
    assert stash.row(a, 128) is None

    # The same layer id seen again: a new forward even under the same batch key.
    before = stash.row(a2, 128)
    assert before is not None
    _begin(stash, 2, 0)
    assert stash.layers == {} and stash.row(a2, 128) is None

    stash.clear()
    assert stash.stash_bytes() == 0 and stash.lookup(_slot("a"), 300) is None
    assert stash.peak_bytes > 0  # peaks survive a clear: they are lifetime figures


def test_without_request_ids_keeps_the_last_grid_point_only():
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=1)
    _begin(stash, 1, 0, rids=False)
    stash.record_layer(0, *_exports(0))
    assert set(stash._rows) == {(_slot("a"), 256), (_slot("b"), 320), (_slot("d"), 192)}
    assert stash.stash_bytes() == 3 * _row_bytes()
    # A batch whose ids do not line up with its sequences is treated the same way.
    assert stash.starts_forward(2, 0)
    stash.begin(2, [5], [0], [300], rids=["a", "extra"])
    stash.record_layer(0, torch.zeros(1, 5, H, V, KD), torch.zeros(300, D, dtype=torch.bfloat16))
    assert set(stash._rows) == {(5, 256)}


def test_nothing_planned_still_records_the_layer():
    stash = ExportStash()
    stash.enable(lambda rid, seq: [], conv_width=WIDTH, num_layers=len(LAYERS))
    for layer in LAYERS:
        _begin(stash, 1, layer)
        stash.record_layer(layer, *_exports(layer))
    assert sorted(stash.layers) == LAYERS and all(r is None for r in stash.layers.values())
    assert stash.stash_bytes() == 0
    a = stash.lookup(_slot("a"), 300)
    assert a is not None and stash.row(a, 256) is None


def test_a_planner_cannot_add_positions_off_the_grid():
    stash = ExportStash()
    stash.enable(lambda rid, seq: [seq.prefix + 100, seq.end, seq.prefix], conv_width=WIDTH, num_layers=1)
    _begin(stash, 1, 0)
    stash.record_layer(0, *_exports(0))
    assert stash._rows == {} and stash.stash_bytes() == 0


# ---------------------------------------------------------------------------- the stores
@pytest.fixture
def pool_and_stash():
    """A real CPU HybridReqToTokenPool for LAYERS, and a cache's forward state (stash enabled as
    the cache does, with the KDA layer count) after one recorded forward."""
    pytest.importorskip("sglang")
    from cpu_pools import hybrid_pool

    from sglang_k3.state.active_slots import SlotPool

    rtp = hybrid_pool(LAYERS, heads=H, head_dim=KD, conv_kernel=WIDTH + 1)
    slots = SlotPool(rtp, lambda n: 0)
    conv = rtp.mamba_pool.mamba_cache.conv[0]
    assert tuple(conv.shape[-2:]) == (WIDTH, D)
    fwd = ForwardState(ExportStash(), DeferredRestores())
    fwd.stash.enable(_planner(PlacementPolicy()), conv_width=int(conv.shape[-2]), num_layers=len(LAYERS))
    full = {}
    for i, layer in enumerate(LAYERS):
        _begin(fwd.stash, 1, layer)
        h, mixed_qkv = _exports(10 + i, torch.float32, conv.dtype)
        full[layer] = (h.clone(), mixed_qkv.clone())
        fwd.stash.record_layer(layer, h, mixed_qkv)
    assert fwd.stash.stacked() is not None
    return rtp, slots, full, fwd


def test_native_store_is_bit_exact_and_refuses_unplanned(pool_and_stash):
    from sglang_k3.state.checkpoint_store import NativeSlotStore

    rtp, slots, full, fwd = pool_and_stash
    store = NativeSlotStore(slots, fwd)
    a = _view(fwd, "a")
    free_before = rtp.mamba_allocator.available_size()
    assert not a.kept(192)  # exported but not planned
    assert store.capture_export(a, 192) is None
    assert rtp.mamba_allocator.available_size() == free_before  # no slot kept
    for rid, pos in sorted(PLANNED):
        dst = store.capture_export(_view(fwd, rid), pos)
        assert dst is not None
        chunk, end = _where(rid, pos)
        for layer in LAYERS:
            h, mixed_qkv = full[layer]
            cache = rtp.mamba2_layer_cache(layer)
            assert torch.equal(cache.temporal[dst], h[0, chunk])  # fp32 state: bit-exact
            assert torch.equal(cache.conv[0][dst], mixed_qkv[end - WIDTH : end])


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_quantized_store_equals_a_store_from_the_full_tensors(pool_and_stash, dtype):
    from sglang_k3.state.checkpoint_pool import CheckpointPool
    from sglang_k3.state.checkpoint_store import QuantizedStore

    rtp, slots, full, fwd = pool_and_stash
    store = QuantizedStore(slots, dtype, num_slots=8, evict_bytes=lambda n: 0, fwd=fwd)
    ref = CheckpointPool.from_mamba_pool(rtp.mamba_pool, num_slots=8, dtype=dtype)
    assert store.capture_export(_view(fwd, "a"), 64) is None
    assert store.pool.available_size() == 8  # nothing allocated for an unplanned state
    for rid, pos in sorted(PLANNED):
        dst = store.capture_export(_view(fwd, rid), pos)
        assert dst is not None
        # The previous code path: chunk index into the full h, conv window from the full stream.
        chunk, end = _where(rid, pos)
        want = ref.alloc(1)
        for layer in LAYERS:
            h, mixed_qkv = full[layer]
            res = ref.store_from_intermediate(
                rtp.mamba_map[layer], h, [chunk], want, state_v_first=True, conv_src=mixed_qkv, token_ends=[end]
            )
            assert res.all_ok
        assert torch.equal(store.pool.q[dst], ref.q[want[0]])
        if ref.scale is not None:
            assert torch.equal(store.pool.scale[dst], ref.scale[want[0]])
        assert torch.equal(store.pool.conv[dst], ref.conv[want[0]])
        active = slots.alloc()  # a hit restores it: the conv window comes back exactly
        store.pool.restore([dst], [active])
        for layer in LAYERS:
            assert torch.equal(
                rtp.mamba2_layer_cache(layer).conv[0][active],
                full[layer][1][end - WIDTH : end].to(rtp.mamba_pool.mamba_cache.conv[0].dtype),
            )
        slots.free([active])


def test_a_forward_is_planned_once_not_at_every_layer():
    """The hook asks ``starts_forward`` at each KDA layer and begins (one device sync for the slot
    list) only at the first layer of a forward: a new batch, or a layer seen again."""
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=len(LAYERS))
    begun = []
    for key, layers in ((1, LAYERS), (1, LAYERS), (2, LAYERS[:1])):
        for layer in layers:
            if stash.starts_forward(key, layer):
                begun.append((key, layer))
                stash.begin(
                    key,
                    [s for _, s, _, _, _, _ in BATCH],
                    [p for _, _, p, _, _, _ in BATCH],
                    [n for _, _, _, n, _, _ in BATCH],
                    rids=[r for r, *_ in BATCH],
                )
            stash.record_layer(layer, *_exports(layer))
    # the same batch object running its layers again is a new forward (e.g. a retried batch)
    assert begun == [(1, LAYERS[0]), (1, LAYERS[0]), (2, LAYERS[0])]
    assert set(stash.layers) == {LAYERS[0]}


def test_stacked_rows_need_every_layer():
    """One forward's kept rows are [num_layers, n, ...] tensors (the layers in the order they ran),
    available only once every layer is recorded; a layer beyond the count is an error."""
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=len(LAYERS))
    for k, layer in enumerate(LAYERS):
        _begin(stash, 1, layer)
        stash.record_layer(layer, *_exports(layer))
        assert (stash.stacked() is None) == (k < len(LAYERS) - 1)
        a = stash.lookup(_slot("a"), 300)
        assert (stash.row(a, 256) is None) == (k < len(LAYERS) - 1)  # no partial state is stored
    stack = stash.stacked()
    assert stack.h.shape == (len(LAYERS), len(PLANNED), H, V, KD)
    assert stack.conv.shape == (len(LAYERS), len(PLANNED), WIDTH, D)
    assert list(stash.layers) == LAYERS
    with pytest.raises(RuntimeError):
        stash.record_layer(99, *_exports(0))
    with pytest.raises(ValueError):
        stash.enable(None, conv_width=WIDTH, num_layers=0)


def test_rows_are_dropped_once_every_planned_sequence_checkpointed():
    """The cache consumes a sequence when its request checkpoints after the forward; once every
    sequence with kept rows is consumed the rows go at once, not at the next extend."""
    stash = ExportStash()
    stash.enable(_planner(PlacementPolicy()), conv_width=WIDTH, num_layers=1)
    _begin(stash, 1, 0)
    stash.record_layer(0, *_exports(0))
    planned_slots = sorted({_slot(rid) for rid, _ in PLANNED})
    stash.consume(_slot("c"))  # nothing planned for it: changes nothing
    for s in planned_slots[:-1]:
        stash.consume(s)
        assert stash.stash_bytes() > 0
    stash.consume(planned_slots[-1])
    assert stash.stash_bytes() == 0 and stash.layers == {}


def test_quantized_exports_of_a_forward_are_stored_ahead_in_one_call(pool_and_stash):
    """With stacked rows, the first request's call stores every kept row of the forward (one
    launch); requests claim their own; what nobody claims is released when the rows are dropped.
    A pool too small for all rows stores the first ones; the rest are simply not available."""
    from sglang_k3.state.checkpoint_store import QuantizedStore

    rtp, slots, full, fwd = pool_and_stash
    order = sorted(PLANNED, key=lambda rp: fwd.stash.row(_view(fwd, rp[0]).seq, rp[1]))

    store = QuantizedStore(slots, "int8", num_slots=8, evict_bytes=lambda n: 0, fwd=fwd)
    rid, pos = order[0]
    got = store.capture_export(_view(fwd, rid), pos)
    assert got is not None
    assert store.pool.available_size() == 8 - len(PLANNED)  # all kept rows stored at once
    assert store.ahead_stored == len(PLANNED)
    rid, pos = order[2]
    assert store.capture_export(_view(fwd, rid), pos) is not None
    assert store.capture_export(_view(fwd, rid), pos) is None  # claimed once
    fwd.stash.clear()  # the next forward begins: the two unclaimed slots go back
    assert store.pool.available_size() == 8 - 2 and store.ahead_unclaimed == len(PLANNED) - 2


def test_stored_ahead_with_a_small_pool(pool_and_stash):
    from sglang_k3.state.checkpoint_store import QuantizedStore

    rtp, slots, full, fwd = pool_and_stash
    order = sorted(PLANNED, key=lambda rp: fwd.stash.row(_view(fwd, rp[0]).seq, rp[1]))
    store = QuantizedStore(slots, "int8", num_slots=2, evict_bytes=lambda n: 0, fwd=fwd)
    got = [store.capture_export(_view(fwd, rid), pos) for rid, pos in reversed(order)]
    assert [g is not None for g in reversed(got)] == [True, True] + [False] * (len(order) - 2)
    assert store.pool.available_size() == 0


def _view(fwd, rid) -> ExportView:
    seq = fwd.stash.lookup(_slot(rid), next(p + n for r, _, p, n, _, _ in BATCH if r == rid))
    return ExportView(fwd.stash, seq)
