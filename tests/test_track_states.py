"""The CPU state-tracking copy that lets upstream's ``extra_buffer`` run on CPU
(``kernels/kda/track_torch.py``), against a per-row loop of what upstream's Triton kernel
documents: each masked row's conv and recurrent state, in every layer, goes from its working slot
to its track slot; rows with a freed slot (-1) are skipped when asked. Seeds in the ids."""

from __future__ import annotations

import pytest
import torch

from sglang_k3.kernels.kda.track_torch import track_states_torch


def _expected(conv, ssm, src, mask, dst, check):
    conv, ssm = conv.clone(), ssm.clone()
    for i in range(len(mask)):
        if not mask[i] or (check and (src[i] < 0 or dst[i] < 0)):
            continue
        conv[:, dst[i]] = conv[:, src[i]]
        ssm[:, dst[i]] = ssm[:, src[i]]
    return conv, ssm


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("layered", [True, False])
def test_track_copy_matches_a_per_row_loop(seed, layered):
    g = torch.Generator().manual_seed(seed)
    layers, pool, bs = 3, 16, 6
    conv = torch.randn(layers, pool, 4, 5, generator=g)
    ssm = torch.randn(layers, pool, 2, 3, 3, generator=g)
    perm = torch.randperm(pool, generator=g)
    src, dst = perm[:bs].clone(), perm[bs : 2 * bs].clone()
    mask = torch.rand(bs, generator=g) < 0.6
    check = seed % 2 == 1
    if check:
        src[0], dst[1] = -1, -1  # freed slots
    want_conv, want_ssm = _expected(conv, ssm, src, mask, dst, check)
    if layered:
        track_states_torch(conv, ssm, src, mask, dst, bs, layered=True, check_freed_slots=check)
        got_conv, got_ssm = conv, ssm
    else:  # one layer at a time, as the per-layer caller passes it
        for layer in range(layers):
            track_states_torch(conv[layer], ssm[layer], src, mask, dst, bs, layered=False, check_freed_slots=check)
        got_conv, got_ssm = conv, ssm
    assert torch.equal(got_conv, want_conv) and torch.equal(got_ssm, want_ssm)
    assert mask.any()  # the seeds exercise at least one copy


def test_an_empty_batch_or_mask_copies_nothing():
    conv, ssm = torch.randn(2, 8, 3), torch.randn(2, 8, 2, 2)
    before = conv.clone(), ssm.clone()
    idx = torch.arange(4)
    track_states_torch(conv, ssm, idx, torch.zeros(4, dtype=torch.bool), idx + 4, 4, layered=True)
    track_states_torch(conv, ssm, idx, torch.ones(4, dtype=torch.bool), idx + 4, 0, layered=True)
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])
