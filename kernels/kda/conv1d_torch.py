"""Causal depthwise conv1d in pure torch, with the conv-state cache SGLang keeps.

Conventions follow upstream's ``causal_conv1d_triton`` (channel-first views):

- prefill ``x``: ``[dim, total_tokens]``, sequences packed left to right by ``query_start_loc``;
- ``conv_states``: ``[num_slots, dim, width - 1]`` (may be a strided view, e.g. the KDA pool's
  ``[slots, width - 1, dim]`` transposed); updated in place for every sequence whose slot is not
  ``pad_slot_id``; after a call it holds the last ``width - 1`` inputs of the sequence (older
  state shifted left when the sequence is shorter than ``width - 1``);
- ``has_initial_state[i]`` False: sequence ``i`` starts from zeros instead of its cached state;
- output = ``silu(bias + sum_w weight[:, w] * window[w])`` (activation optional), in ``x.dtype``.

Rows whose slot is ``pad_slot_id`` are computed from a zero history and do not touch the cache
(upstream leaves them unwritten; they are padding either way).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


def _act(y: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(y)
    if activation in (None, False):
        return y
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d_varlen_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: Optional[torch.Tensor],
    query_start_loc: torch.Tensor,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Varlen causal conv1d prefill with conv-state in/out. ``x`` ``[dim, T]`` -> ``[dim, T]``."""
    dim, T = x.shape
    if T == 0:  # nothing to convolve; every conv state stays as it was
        return torch.empty_like(x)
    W = weight.shape[1]
    P = W - 1
    cu = query_start_loc.to(torch.long).cpu()
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    seq_of_tok = torch.repeat_interleave(torch.arange(N), lens, output_size=T)

    xf = x.float()
    # Extended stream: each sequence is preceded by its P-token history.
    ext = xf.new_zeros(dim, T + N * P)
    tok_pos = torch.arange(T) + (seq_of_tok + 1) * P
    ext[:, tok_pos] = xf
    if N == 0:
        return torch.empty_like(x)
    slots = cache_indices.to(torch.long).cpu() if cache_indices is not None else torch.arange(N, dtype=torch.long)
    has_slot = slots != pad_slot_id
    if conv_states is not None:
        load = has_slot.clone()
        if has_initial_state is not None:
            load &= has_initial_state.to(torch.bool).cpu()
        ld = load.nonzero(as_tuple=True)[0]
        if ld.numel() > 0:
            hist_pos = (cu[ld] + ld * P).unsqueeze(1) + torch.arange(P)  # [n, P]
            hist = conv_states[slots[ld]].float()  # [n, dim, P]
            ext[:, hist_pos.reshape(-1)] = hist.permute(1, 0, 2).reshape(dim, -1)
    y = F.conv1d(ext.unsqueeze(0), weight.float().unsqueeze(1), None, groups=dim)[0]
    out = y[:, torch.arange(T) + seq_of_tok * P]
    if bias is not None:
        out = out + bias.float().unsqueeze(1)
    out = _act(out, activation).to(x.dtype)

    if conv_states is not None:
        wr = has_slot.nonzero(as_tuple=True)[0]
        if wr.numel() > 0:
            tail_pos = (cu[wr] + wr * P + lens[wr]).unsqueeze(1) + torch.arange(P)  # [n, P]
            tail = ext[:, tail_pos.reshape(-1)].reshape(dim, -1, P).permute(1, 0, 2)
            conv_states[slots[wr]] = tail.to(conv_states.dtype)
    return out


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation=None,
    conv_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode-time conv1d: ``x`` ``[B, dim]`` or ``[B, dim, L]``; ``conv_state``
    ``[slots, dim, >= width - 1]`` updated in place (sliding window). Returns ``x``'s shape.

    Speculative verify (a chain of ``L`` draft tokens per row): with ``intermediate_conv_window``
    ``[rows, >= L, dim, state_len]`` the window after each token ``t`` (what ``conv_state`` would
    hold had the row stopped there) is also written to
    ``intermediate_conv_window[intermediate_state_indices[b], t]``, from which SGLang restores the
    accepted length's window after the verify."""
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    B, dim, L = x.shape
    W = weight.shape[1]
    P = W - 1
    slots = conv_state_indices.to(torch.long) if conv_state_indices is not None else torch.arange(B, dtype=torch.long)
    valid = slots != pad_slot_id
    state_len = conv_state.shape[-1]
    hist = x.new_zeros(B, dim, state_len, dtype=torch.float32)
    vi = valid.nonzero(as_tuple=True)[0]
    if vi.numel() > 0:
        hist[vi] = conv_state[slots[vi]].float()
    window = torch.cat([hist, x.float()], -1)  # [B, dim, state_len + L]
    ctx = window[..., state_len - P :]  # the P most recent history entries + x
    y = F.conv1d(
        ctx.reshape(1, B * dim, P + L),
        weight.float().repeat(B, 1).unsqueeze(1),
        None,
        groups=B * dim,
    ).reshape(B, dim, L)
    if bias is not None:
        y = y + bias.float().view(1, dim, 1)
    y = _act(y, activation).to(x.dtype)
    if vi.numel() > 0:
        conv_state[slots[vi]] = window[vi, :, L:].to(conv_state.dtype)
        if intermediate_conv_window is not None:
            rows = intermediate_state_indices[:B].to(torch.long).cpu()[vi]
            for t in range(L):
                intermediate_conv_window[rows, t] = window[vi, :, t + 1 : t + 1 + state_len].to(
                    intermediate_conv_window.dtype
                )
    return y.squeeze(-1) if squeeze else y
