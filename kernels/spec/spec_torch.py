"""SGLang's speculative-decoding ops in pure torch, one per upstream kernel (contracts in each
docstring; upstream names in ``kernels/spec/__init__.py``). Loops run over requests and tree
nodes, which are few; the tensors they index may be any size."""

from __future__ import annotations

from typing import Optional

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM's verify metadata from its draft tree (``reconstruct_indices_from_tree_mask``).

    ``tree_mask[b, i, j]`` (flat, row-major) marks node ``j`` an ancestor of node ``i`` (or ``i``
    itself). Per request ``b`` and node ``i``, in place: ``positions = verified_seq_len[b] +
    #strict ancestors``; ``retrieve_index = b * n + i``; ``retrieve_next_token`` = the first
    child (smallest later node whose parent is ``i``), else -1; ``retrieve_next_sibling`` = the
    next node after ``i`` with the same parent, else -1 (-1 for the root). A node's parent is its
    deepest (largest-numbered) strict ancestor."""
    n = draft_token_num
    if batch_size == 0:
        return
    m = tree_mask[: batch_size * n * n].reshape(batch_size, n, n).to(torch.bool).cpu()
    order = torch.arange(n)
    anc = m & (order.view(1, 1, n) < order.view(1, n, 1))  # [b, i, j]: j a strict ancestor of i
    depth = anc.sum(-1)
    positions[: batch_size * n] = (
        (verified_seq_len[:batch_size].to(torch.long).cpu().view(-1, 1) + depth).reshape(-1).to(positions.dtype)
    )
    retrieve_index[:batch_size] = (torch.arange(batch_size).view(-1, 1) * n + order.view(1, -1)).to(
        retrieve_index.dtype
    )
    parent = torch.where(anc.any(-1), (anc * order.view(1, 1, n)).argmax(-1), torch.full_like(depth, -1))
    nxt = torch.full((batch_size, n), -1, dtype=torch.long)
    sib = torch.full((batch_size, n), -1, dtype=torch.long)
    for b in range(batch_size):
        first_child: dict[int, int] = {}
        for i in range(n - 1, -1, -1):  # descending: every later node is known when i is reached
            nxt[b, i] = first_child.get(i, -1)
            p = int(parent[b, i])
            if p >= 0:
                sib[b, i] = first_child.get(p, -1)
                first_child[p] = i
    retrieve_next_token[:batch_size] = nxt.to(retrieve_next_token.dtype)
    retrieve_next_sibling[:batch_size] = sib.to(retrieve_next_sibling.dtype)


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device,
) -> torch.Tensor:
    """The KV locations of each request's tokens ``[start, end)``, concatenated
    (``assign_extend_cache_locs_func``; a platform's ``get_speculative_cache_locs_fn``)."""
    if batch_size == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    rows = req_pool_indices[:batch_size].to(torch.long)
    s, e = start_offset[:batch_size].to(torch.long), end_offset[:batch_size].to(torch.long)
    return torch.cat([req_to_token[r, a:b] for r, a, b in zip(rows.tolist(), s.tolist(), e.tolist())]).to(torch.int64)


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Write ``out_cache_loc`` (each request's new locations, concatenated in batch order) into
    ``req_to_token[req, start:end]`` (``assign_req_to_token_pool_func``)."""
    pos = 0
    rows = req_pool_indices[:batch_size].to(torch.long).tolist()
    starts = start_offset[:batch_size].to(torch.long).tolist()
    ends = end_offset[:batch_size].to(torch.long).tolist()
    for r, a, b in zip(rows, starts, ends):
        req_to_token[r, a:b] = out_cache_loc[pos : pos + (b - a)].to(req_to_token.dtype)
        pos += b - a


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    topk: int,
    num_cols: int,
    positions: Optional[torch.Tensor] = None,
    mrope: Optional[torch.Tensor] = None,
) -> None:
    """Request ``b``'s ``topk * num_cols`` KV locations from ``seq_lens[b]`` on, into
    ``out_cache_loc[b * topk * num_cols:]``; with ``positions``, ``positions[b * topk + j] =
    seq_lens[b]`` (and each of ``mrope``'s three rows the same) for the ``topk`` drafts
    (``assign_draft_cache_locs_contiguous_func``)."""
    bs = seq_lens.shape[0]
    if bs == 0:
        return
    n = topk * num_cols
    start = seq_lens.to(torch.long).view(-1, 1)
    cols = start + torch.arange(n, device=seq_lens.device).view(1, -1)
    rows = req_pool_indices[:bs].to(torch.long).view(-1, 1)
    out_cache_loc[: bs * n] = req_to_token[rows, cols].reshape(-1).to(out_cache_loc.dtype)
    if positions is not None:
        positions[: bs * topk] = start.expand(bs, topk).reshape(-1).to(positions.dtype)
        if mrope is not None:
            mrope.view(3, -1)[:, : bs * topk] = start.expand(bs, topk).reshape(1, -1).to(mrope.dtype)


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int = 0,
) -> None:
    """An EAGLE draft's verify tree from its top-scored draft tokens
    (``build_tree_kernel_efficient_func``), in place, for tree mask modes 0 (``FULL_MASK``: each
    request's rows span its ``seq_lens[b]`` prefix columns, which the caller set, then the ``n``
    tree columns) and 1 (``QLEN_ONLY``: ``n x n`` per request).

    Node 0 of request ``b`` is the verified (bonus) token; node ``i >= 1`` is draft
    ``top_scores_index[b, i - 1]``, whose parent is draft ``parent_list[b, idx // topk]``, found
    among the selected drafts (node 0 when ``idx // topk`` is 0; none when not selected).
    Writes ``retrieve_index[b, i] = b * n + i``; ``retrieve_next_token`` (the last-numbered
    child) and ``retrieve_next_sibling`` (the next-lower-numbered child of the same parent);
    ``positions[b * n + i] = seq_lens[b] + depth(i)``, the depth counted over at most
    ``spec_steps`` ancestors; and mask row ``i``: node 0 and each node on the path up from
    ``i``, ``i`` itself included."""
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"tree mask mode {tree_mask_mode}: only FULL_MASK (0) and QLEN_ONLY (1)")
    n = num_verify_tokens
    bs = seq_lens.shape[0]
    sel = top_scores_index.reshape(bs, -1).to(torch.long).cpu().tolist()
    parents = parent_list.reshape(bs, -1).to(torch.long).cpu().tolist()
    lens = seq_lens.to(torch.long).cpu().tolist()
    offset = 0
    for b in range(bs):
        chosen, plist, seq_len = sel[b], parents[b], lens[b]
        # parent[i]: node i's parent node (0 when its draft hangs off the root; -1 when its parent
        # draft is not among the selected)
        parent = [-1] * n
        for i in range(1, n):
            tb = chosen[i - 1] // topk
            if tb == 0:
                parent[i] = 0
            elif plist[tb] in chosen[: n - 1]:
                parent[i] = chosen.index(plist[tb], 0, n - 1) + 1
        retrieve_index[b, :n] = torch.arange(b * n, (b + 1) * n, dtype=retrieve_index.dtype)
        for i in range(n - 1, 0, -1):
            p = parent[i]
            if p >= 0:
                first = int(retrieve_next_token[b, p])
                if first != -1:
                    retrieve_next_sibling[b, i] = first
                retrieve_next_token[b, p] = i
        positions[b * n] = seq_len
        for x in range(n):
            row = n * n * b + (offset * n + (seq_len + n) * x + seq_len if mode == 0 else n * x)
            tree_mask[row] = True
            tree_mask[row + 1 : row + n] = False
            if x == 0:
                continue
            node, depth = x, 0
            for _ in range(spec_steps):
                depth += 1
                tree_mask[row + node] = True
                node = parent[node]
                if node <= 0:
                    break
            positions[b * n + x] = seq_len + depth
        offset += seq_len


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
    batch_size: int,
) -> None:
    """``bonus_tokens[b]`` = request ``b``'s last accepted token: ``accept_tokens`` (flat, each
    request ``accept_stride`` wide) at ``accept_lens[b] - 1`` (``fill_bonus_tokens_func``)."""
    if batch_size == 0:
        return
    last = (
        torch.arange(batch_size, device=accept_lens.device) * accept_stride
        + accept_lens[:batch_size].to(torch.long)
        - 1
    )
    bonus_tokens[:batch_size] = accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype)


def fill_front_out_cache_loc(num_front: torch.Tensor, out_cache_loc: torch.Tensor, front_out_cache_loc: torch.Tensor):
    """Pack the first ``num_front[i]`` entries of request ``i``'s window of ``out_cache_loc``
    (``out_cache_loc.view(bs, -1)``) into ``front_out_cache_loc``, in order
    (``fill_front_out_cache_loc_func``)."""
    bs = num_front.numel()
    window = out_cache_loc.view(bs, -1)
    pos = 0
    for i, n in enumerate(num_front.to(torch.long).tolist()):
        front_out_cache_loc[pos : pos + n] = window[i, :n].to(front_out_cache_loc.dtype)
        pos += n


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor, size: int
):
    """``accept_out_cache_loc[k] = out_cache_loc[j]`` for the ``k``-th entry ``j`` of
    ``accept_index`` (flat, first ``size``) that is not -1 (``fill_accept_out_cache_loc_func``)."""
    flat = accept_index.reshape(-1)[:size].to(torch.long)
    kept = flat[flat != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    topk: int = -1,
):
    """Greedy acceptance over a draft tree (``verify_tree_greedy_func``). Per request, from the
    root: among the children of the last accepted node, accept the first (in sibling order) whose
    draft token equals the target's greedy token at the last accepted node; stop when none does.
    In place: ``accept_index[b, 0..m]`` (flat draft indices of the root and the accepted nodes),
    ``accept_token_num[b] = m``, and ``predicts[idx]`` = the target's token at every accepted node
    (the last one's is the bonus token). Returns the three outputs."""
    bs = candidates.shape[0]
    steps = accept_index.shape[1]
    tp = target_predict.reshape(-1).tolist()
    cand = candidates.tolist()
    ridx = retrieve_index.tolist()
    nxt = retrieve_next_token.tolist()
    sib = retrieve_next_sibling.tolist()
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            target = tp[last]
            while cur != -1 and cand[b][cur] != target:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = target
            accepted += 1
            last = ridx[b][cur]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = tp[last]
    return predicts, accept_index, accept_token_num
