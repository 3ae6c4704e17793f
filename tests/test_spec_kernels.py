"""The CPU path of speculative decoding (issue #34), op by op, against what the op must equal.

* The KDA verify of a draft chain (``kda_target_verify_pool``): the state after each draft token
  and the outputs equal plain decode run one token at a time; the pool is not written.
* The conv verify (``causal_conv1d_update_torch`` with per-step windows): each step's window
  equals the conv state plain decode leaves after that token.
* The commit (``scatter_mamba_states_after_mtp_verify``, SGLang's own torch fallback applied to
  every state): each slot takes its accepted step.
* The draft tree's indices (``reconstruct_indices_from_tree_mask``) equal SGLang's own host
  derivation (``ngram_worker._derive_tree_links``) on random trees.
* Greedy verify (``verify_tree_greedy``) accepts the longest path of drafts that equal the
  target's greedy tokens, as a search over every root-to-node path finds it.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_k3.kernels.kda.conv1d_torch import causal_conv1d_update_torch
from sglang_k3.kernels.kda.pool_ops import kda_recurrent_decode_pool, kda_target_verify_pool
from sglang_k3.kernels.spec import spec_torch

H, K, V = 2, 8, 8


def _verify_inputs(gen, n_req: int, d: int):
    t = n_req * d
    return (
        torch.randn(1, t, H, K, generator=gen),
        torch.randn(1, t, H, K, generator=gen),
        torch.randn(1, t, H, V, generator=gen),
        torch.randn(t, H * K, generator=gen),
        torch.randn(1, t, H, generator=gen),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_kda_chain_verify_equals_decode_token_by_token(seed):
    gen = torch.Generator().manual_seed(seed)
    n_req, d, slots = 3, 4, 7
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    pool = torch.randn(slots, H, V, K, generator=gen)
    cache = torch.tensor([5, 0, 3])
    rows = torch.tensor([2, 0, 1])  # the scratch is indexed by verify row, not by slot
    scratch = torch.zeros(4, d, H, V, K)
    q, k, v, a, b = _verify_inputs(gen, n_req, d)
    before = pool.clone()
    o = kda_target_verify_pool(
        q,
        k,
        v,
        a,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        ssm_states=pool,
        cache_indices=cache,
        query_start_loc=torch.arange(0, n_req * d + 1, d),
        intermediate_states_buffer=scratch,
        intermediate_state_indices=rows,
        cache_steps=d,
    )
    assert torch.equal(pool, before)  # the commit writes the slot, not the verify
    ref = before.clone()
    for t in range(d):
        tok = torch.arange(n_req) * d + t
        od = kda_recurrent_decode_pool(
            q[:, tok],
            k[:, tok],
            v[:, tok],
            a[tok],
            b[:, tok],
            A_log=A_log,
            dt_bias=dt_bias,
            ssm_states=ref,
            cache_indices=cache,
            query_start_loc=torch.arange(n_req + 1),
        )
        torch.testing.assert_close(o[:, tok], od, rtol=1e-5, atol=1e-5)
        for i in range(n_req):
            torch.testing.assert_close(scratch[rows[i], t], ref[cache[i]], rtol=1e-5, atol=1e-5)


def test_conv_verify_windows_equal_the_decode_states_after_each_token():
    gen = torch.Generator().manual_seed(2)
    n_req, dim, width, d = 3, 6, 4, 5
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    state = torch.randn(4, dim, width - 1, generator=gen)
    slots = torch.tensor([3, 1, 0])
    windows = torch.zeros(n_req, d, dim, width - 1)
    x = torch.randn(n_req, dim, d, generator=gen)
    ref = state.clone()
    y = causal_conv1d_update_torch(
        x,
        state,
        weight,
        bias,
        activation="silu",
        conv_state_indices=slots,
        intermediate_conv_window=windows,
        intermediate_state_indices=torch.arange(n_req),
    )
    for t in range(d):
        yt = causal_conv1d_update_torch(x[..., t], ref, weight, bias, activation="silu", conv_state_indices=slots)
        torch.testing.assert_close(y[..., t], yt)
        for i in range(n_req):
            assert torch.equal(windows[i, t], ref[slots[i]]), (i, t)


def test_the_commit_leaves_each_slot_at_its_accepted_step():
    """After a verify the slot takes the state and conv window of its last accepted step; a step
    of -1 (a padded row) leaves its slot alone."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(3)
    layers, slots, rows, d = 2, 6, 3, 4
    temporal = torch.randn(layers, slots, H, V, K, generator=gen)
    conv = torch.randn(layers, slots, 3, 5, generator=gen)
    caches = SimpleNamespace(
        temporal=temporal,
        intermediate_ssm=torch.randn(layers, rows + 1, d, H, V, K, generator=gen),
        conv=[conv],
        intermediate_conv_window=[torch.randn(layers, rows + 1, d, 3, 5, generator=gen)],
    )
    before = temporal.clone()
    pytest.importorskip("sglang")
    from sglang_k3.patches.spec_scatter_mamba_states import scatter_after_verify_cpu

    scatter_after_verify_cpu(caches, torch.tensor([4, 1, 2]), torch.tensor([2, 0, -1]), None, None)
    assert torch.equal(temporal[:, 4], caches.intermediate_ssm[:, 0, 2])
    assert torch.equal(temporal[:, 1], caches.intermediate_ssm[:, 1, 0])
    assert torch.equal(conv[:, 4], caches.intermediate_conv_window[0][:, 0, 2])
    assert torch.equal(temporal[:, 2], before[:, 2])  # step -1: untouched


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _mask(parents: list[list[int]]) -> torch.Tensor:
    bs, n = len(parents), len(parents[0])
    m = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, par in enumerate(parents):
        for i in range(n):
            j = i
            while j >= 0:
                m[b, i, j] = True
                j = par[j]
    return m.reshape(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_indices_equal_sglangs_host_derivation(seed):
    pytest.importorskip("sglang")
    from sglang_k3.patches import spec_reconstruct_tree

    spec_reconstruct_tree.register()  # the plugin's shim, so SGLang's NGRAM worker imports on CPU
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    rng = random.Random(seed)
    bs, n = 4, 6
    parents = [_random_tree(rng, n) for _ in range(bs)]
    mask = _mask(parents)
    seq = torch.tensor([rng.randrange(10, 90) for _ in range(bs)])
    pos, idx = torch.empty(bs * n, dtype=torch.int64), torch.empty(bs, n, dtype=torch.int64)
    nxt, sib = torch.empty(bs, n, dtype=torch.int64), torch.empty(bs, n, dtype=torch.int64)
    spec_torch.reconstruct_indices_from_tree_mask(mask, seq, pos, idx, nxt, sib, bs, n)
    want_next, want_sib = _derive_tree_links(mask.numpy(), bs, n)
    assert torch.equal(nxt, want_next) and torch.equal(sib, want_sib)
    depth = mask.reshape(bs, n, n).sum(-1) - 1
    assert torch.equal(pos, (seq.view(-1, 1) + depth).reshape(-1))
    assert torch.equal(idx, torch.arange(bs * n).view(bs, n))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_verify_accepts_the_longest_matching_path(seed):
    rng = random.Random(seed)
    bs, n, vocab = 3, 7, 3  # a small vocabulary, so drafts often match
    parents = [_random_tree(rng, n) for _ in range(bs)]
    mask = _mask(parents)
    pos, idx = torch.empty(bs * n, dtype=torch.int64), torch.empty(bs, n, dtype=torch.int64)
    nxt, sib = torch.empty(bs, n, dtype=torch.int64), torch.empty(bs, n, dtype=torch.int64)
    spec_torch.reconstruct_indices_from_tree_mask(mask, torch.zeros(bs, dtype=torch.long), pos, idx, nxt, sib, bs, n)
    cand = torch.tensor([[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)])
    target = torch.tensor([[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)])
    predicts = torch.full((bs * n,), -7, dtype=torch.int64)
    accept_index = torch.full((bs, n), -1, dtype=torch.int64)
    accept_num = torch.zeros(bs, dtype=torch.int64)
    spec_torch.verify_tree_greedy(predicts, accept_index, accept_num, cand, idx, nxt, sib, target)
    for b in range(bs):
        # every node whose whole path from the root matches the target's greedy tokens
        ok = {0}
        for i in range(1, n):
            p = parents[b][i]
            if p in ok and cand[b, i] == target[b, p]:
                ok.add(i)
        path = [0]
        while True:  # greedy order: the first child in sibling order that matches
            kids = [i for i in range(1, n) if parents[b][i] == path[-1] and i in ok]
            if not kids:
                break
            path.append(min(kids))
        assert accept_num[b] == len(path) - 1
        assert accept_index[b, : len(path)].tolist() == [b * n + i for i in path]
        assert [int(predicts[b * n + i]) for i in path] == [int(target[b, i]) for i in path]


def test_cache_location_bookkeeping():
    req_to_token = torch.arange(40).view(4, 10) + 100
    locs = spec_torch.assign_extend_cache_locs(
        torch.tensor([2, 0]), req_to_token, torch.tensor([3, 5]), torch.tensor([6, 8]), 2, 3, "cpu"
    )
    assert locs.tolist() == [123, 124, 125, 105, 106, 107]
    spec_torch.assign_req_to_token_pool(
        torch.tensor([1, 3]), req_to_token, torch.tensor([0, 8]), torch.tensor([2, 10]), torch.tensor([7, 8, 9, 6]), 2
    )
    assert req_to_token[1, :2].tolist() == [7, 8] and req_to_token[3, 8:].tolist() == [9, 6]
    front = torch.zeros(5, dtype=torch.int64)
    spec_torch.fill_front_out_cache_loc(torch.tensor([2, 3]), torch.arange(8) + 50, front)
    assert front.tolist() == [50, 51, 54, 55, 56]
    out = torch.zeros(8, dtype=torch.int64)
    spec_torch.fill_accept_out_cache_loc(torch.tensor([[0, 2, -1, -1], [4, -1, -1, -1]]), torch.arange(8) + 70, out, 8)
    assert out[:3].tolist() == [70, 72, 74] and out[3:].tolist() == [0] * 5


def test_eagle_draft_locations_and_bonus_tokens():
    req_to_token = torch.arange(60).view(3, 20) + 100
    out = torch.full((6,), -1, dtype=torch.int64)
    positions = torch.full((4,), -1, dtype=torch.int64)
    seq = torch.tensor([5, 11])
    spec_torch.assign_draft_cache_locs_contiguous(torch.tensor([2, 0]), req_to_token, seq, out, 2, 1, positions)
    assert out[:4].tolist() == [145, 146, 111, 112] and out[4:].tolist() == [-1, -1]
    assert positions.tolist() == [5, 5, 11, 11]
    bonus = torch.zeros(3, dtype=torch.int32)
    accept = torch.tensor([[7, 8, 9], [4, 0, 0], [1, 2, 0]])
    spec_torch.fill_bonus_tokens(accept.reshape(-1), torch.tensor([3, 1, 2]), bonus, 3, 3)
    assert bonus.tolist() == [9, 4, 2]


def _eagle_draft_tree(gen, bs: int, topk: int, steps: int, n: int):
    """A draft's (parent_list, top_scores_index) as SGLang's own draft loop makes them: its
    top-k selection per step (``select_top_k_tokens``; the later steps' compiled function run
    uncompiled) over random draft probabilities, then ``organize_draft_results``."""
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable", None)
    later = later or spec_utils._select_top_k_tokens_later
    scores, tree = None, []
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        p = torch.rand(rows, topk, generator=gen)
        tok = torch.randint(0, 50, (rows, topk), generator=gen)
        if i == 0:
            _, _, scores, info = spec_utils._select_top_k_tokens_first(p, tok, None, topk)
        else:
            _, _, scores, info = later(i, p, tok, None, scores, topk)
        tree.append(info)
    return organize_draft_results([t[0] for t in tree], [t[1] for t in tree], [t[2] for t in tree], n)[:2]


@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (1, 1, 2), (2, 3, 6), (3, 2, 5), (4, 4, 9)])
@pytest.mark.parametrize("mode", [0, 1])
def test_eagle_tree_from_sglangs_own_draft_selection(topk, steps, n, mode):
    """The verify tree built from a draft's selection: its mask rows are each node's path to the
    root (node 0 and the node itself included), every row extends its parent's by one node, the
    positions are the prefix length plus the depth, and the links equal what the mask alone
    implies (``reconstruct_indices_from_tree_mask``, checked against SGLang's own derivation
    above). A chain (topk 1) is the sequence itself."""
    pytest.importorskip("sglang")
    gen = torch.Generator().manual_seed(topk * 100 + steps * 10 + n + mode)
    bs = 3
    parent_list, top = _eagle_draft_tree(gen, bs, topk, steps, n)
    seq = torch.tensor([7, 12, 30])
    total = int(seq.sum())
    mask = torch.ones(total * n + n * n * bs if mode == 0 else n * n * bs, dtype=torch.bool)
    pos = torch.empty(bs * n, dtype=torch.long)
    idx, nxt, sib = torch.full((3, bs, n), -1, dtype=torch.long)
    spec_torch.build_tree_kernel_efficient(parent_list, top, seq, mask, pos, idx, nxt, sib, topk, steps, n, mode)
    rows, off = [], 0
    for b in range(bs):  # each request's n x n tree block (after its prefix columns in FULL_MASK)
        L = int(seq[b])
        if mode == 0:
            block = mask[n * n * b + off * n :][: n * (L + n)].view(n, L + n)
            assert block[:, :L].all()  # the prefix columns stay as the caller set them
            rows.append(block[:, L:])
        else:
            rows.append(mask[n * n * b :][: n * n].view(n, n))
        off += L
    tree = torch.stack(rows)
    for b in range(bs):
        for i in range(n):
            row = tree[b, i]
            assert row[0] and row[i] and not row[i + 1 :].any()
            if i:
                parent = int(torch.nonzero(row[:i]).max())  # the deepest other node on the path
                want = tree[b, parent].clone()
                want[i] = True
                assert torch.equal(row, want), (b, i)
    depth = tree.sum(-1) - 1
    assert torch.equal(pos, (seq.view(-1, 1) + depth).reshape(-1))
    assert torch.equal(idx, torch.arange(bs * n).view(bs, n))
    r_pos, r_idx = torch.empty(bs * n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    r_nxt, r_sib = torch.empty(bs, n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    spec_torch.reconstruct_indices_from_tree_mask(tree.reshape(-1), seq, r_pos, r_idx, r_nxt, r_sib, bs, n)
    assert torch.equal(nxt, r_nxt) and torch.equal(sib, r_sib) and torch.equal(pos, r_pos)
    if topk == 1:
        assert torch.equal(tree[0], torch.ones(n, n, dtype=torch.bool).tril())
        assert nxt[0].tolist() == [*range(1, n), -1] and (sib == -1).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_each_draft_step_attends_to_the_prefix_and_the_chain_so_far(seed):
    """More than one EAGLE draft step on CPU (``patches/spec_draft_backend_torch_native``): draft
    step ``i`` writes its token's KV at the request's row position ``seq_len + i`` and attends to
    the ``seq_len + i + 1`` entries up to it, as plain softmax attention over those rows computes
    it, over SGLang's own pools; the batch keeps its committed lengths."""
    import math
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_k3.patches.spec_draft_backend_torch_native import TorchNativeMultiStepDraftBackend

    gen, steps, d = torch.Generator().manual_seed(seed), 4, 8
    kv = MHATokenToKVPool(128, 1, torch.float32, H, d, 1, "cpu", False)
    rows = ReqToTokenPool(4, 48, "cpu", False)
    lens = torch.tensor([5, 11], dtype=torch.int64)
    req = torch.tensor([2, 0], dtype=torch.int64)
    locs = torch.randperm(127, generator=gen)[: 2 * 40].view(2, 40) + 1  # scattered KV slots, never 0
    for r, row in zip(req.tolist(), locs):
        rows.req_to_token[r, :40] = row.to(rows.req_to_token.dtype)
    for buf in (kv.k_buffer[0], kv.v_buffer[0]):  # the committed prefixes' KV (and stale slots)
        buf.copy_(torch.randn(buf.shape, generator=gen))
    runner = SimpleNamespace(device="cpu", req_to_token_pool=rows, token_to_kv_pool=kv)
    backend = TorchNativeMultiStepDraftBackend(runner, 1, steps)
    assert len(backend.attn_backends) == steps - 1  # the last step only samples
    layer = RadixAttention(H, d, 1 / math.sqrt(d), H, 0)
    batch = SimpleNamespace(seq_lens=lens.clone(), req_pool_indices=req, encoder_lens=None, out_cache_loc=None)
    backend.init_forward_metadata(batch)
    for i, step in enumerate(backend.attn_backends):
        batch.out_cache_loc = torch.stack([locs[0, lens[0] + i], locs[1, lens[1] + i]])
        q, k, v = (torch.randn(2, H, d, generator=gen) for _ in range(3))  # as RadixAttention hands them
        out = step.forward_decode(q, k, v, layer, batch).view(2, H, d)
        assert torch.equal(batch.seq_lens, lens)
        for b in range(2):
            ids = locs[b, : lens[b] + i + 1]
            keys, vals = kv.k_buffer[0][ids], kv.v_buffer[0][ids]  # [n, H, d]
            assert torch.equal(keys[-1], k[b])  # its own token's KV, written first
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], keys) / math.sqrt(d), dim=-1)
            torch.testing.assert_close(out[b], torch.einsum("hn,nhd->hd", w, vals))
    with pytest.raises(ValueError, match="chains only"):
        TorchNativeMultiStepDraftBackend(runner, 2, steps)
