"""The CPU patches, applied through SGLang's HookRegistry, and exercised through upstream's own
call sites: ``KDAAttnBackend.forward_extend`` / ``forward_decode`` (sglang 0.5.23) run unmodified
on a minimal backend object holding a KDA-layout state pool, and ``FusedRMSNormGated``.

The reference is computed independently: a direct per-token causal convolution and fla's
``naive_recurrent_kda`` over each request's whole token stream (prefill + continuation + decode).
Seeds are fixed per test.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches register only without CUDA")

TARGET_MODULES = [
    "sglang.kernels.ops.mamba.causal_conv1d_triton",
    "sglang.kernels.ops.attention.fla.fused_norm_gate",
    "sglang.srt.layers.attention.linear.kernels.kda_triton",
    "sglang.srt.layers.attention.linear.kda_backend",
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton",
]


def _restore(wrapped_to_original):
    """Undo the monkey-patching (HookRegistry has no un-apply): put originals back everywhere."""
    for mod in list(sys.modules.values()):
        if not isinstance(mod, types.ModuleType):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for name, val in items:
            for wrapped, original in wrapped_to_original:
                if val is wrapped:
                    setattr(mod, name, original)


@pytest.fixture(scope="module")
def patched():
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry

    mods = {m: importlib.import_module(m) for m in TARGET_MODULES}
    import sglang_k3.patches as P

    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    kt = mods["sglang.srt.layers.attention.linear.kernels.kda_triton"].TritonKDAKernel
    originals = {
        "fn": mods["sglang.kernels.ops.mamba.causal_conv1d_triton"].causal_conv1d_fn,
        "update": mods["sglang.kernels.ops.mamba.causal_conv1d_triton"].causal_conv1d_update,
        "track": mods["sglang.kernels.ops.mamba.mamba_state_scatter_triton"]._launch_track_mamba_states,
        "norm": mods["sglang.kernels.ops.attention.fla.fused_norm_gate"].rms_norm_gated,
        **{m: kt.__dict__[m] for m in ("extend", "decode", "packed_decode", "target_verify")},
    }
    # Only the CPU replacements of the KDA kernels are under test here (the other patch modules
    # hook the scheduler, the tokenizer and the speculative path, and are exercised through real
    # servers; the speculative ops also in test_spec_kernels.py).
    kda_kernels = {
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn",
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update",
        "sglang.kernels.ops.attention.fla.fused_norm_gate.rms_norm_gated",
        "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel",
        "sglang.kernels.ops.mamba.mamba_state_scatter_triton._launch_track_mamba_states",
    }
    cpu_modules = [importlib.import_module(f"sglang_k3.patches.{m}") for m in P.PATCH_MODULES]
    cpu_modules = [m for m in cpu_modules if getattr(m, "CPU_ONLY", False) and m.TARGET in kda_kernels]
    for m in cpu_modules:
        m.register()
    targets = [m.TARGET for m in cpu_modules]
    HookRegistry.apply_hooks()
    assert set(targets) == kda_kernels
    yield mods
    pairs = [
        (mods["sglang.kernels.ops.mamba.causal_conv1d_triton"].causal_conv1d_fn, originals["fn"]),
        (mods["sglang.kernels.ops.mamba.causal_conv1d_triton"].causal_conv1d_update, originals["update"]),
        (mods["sglang.kernels.ops.attention.fla.fused_norm_gate"].rms_norm_gated, originals["norm"]),
        (mods["sglang.kernels.ops.mamba.mamba_state_scatter_triton"]._launch_track_mamba_states, originals["track"]),
    ]
    _restore(pairs)
    for m in ("extend", "decode", "packed_decode", "target_verify"):
        setattr(kt, m, originals[m])
    HookRegistry.reset()
    HookRegistry._hooks.update(saved_hooks)
    HookRegistry._patched.update(saved_patched)
    P._registered = False


def test_hooks_reach_every_call_site(patched):
    from sglang_k3.patches import causal_conv1d_fn, causal_conv1d_update, kda_triton_kernel, rms_norm_gated

    conv = patched["sglang.kernels.ops.mamba.causal_conv1d_triton"]
    kb = patched["sglang.srt.layers.attention.linear.kda_backend"]
    norm = patched["sglang.kernels.ops.attention.fla.fused_norm_gate"]
    kt = patched["sglang.srt.layers.attention.linear.kernels.kda_triton"].TritonKDAKernel
    # kda_backend imported the conv functions by name: the patch must have propagated there.
    assert kb.causal_conv1d_fn.__wrapped__ is not None
    assert conv.causal_conv1d_fn is kb.causal_conv1d_fn
    assert conv.causal_conv1d_update is kb.causal_conv1d_update
    assert getattr(kb.causal_conv1d_update, "__module__", "") != "sgl_kernel.mamba"
    for fn, impl in (
        (conv.causal_conv1d_fn, causal_conv1d_fn.causal_conv1d_fn_cpu),
        (conv.causal_conv1d_update, causal_conv1d_update.causal_conv1d_update_cpu),
        (norm.rms_norm_gated, rms_norm_gated.rms_norm_gated_cpu),
    ):
        assert fn.__closure__ is not None and any(c.cell_contents is impl for c in fn.__closure__)
    for name, impl in kda_triton_kernel.METHODS.items():
        meth = getattr(kt, name)
        assert any(c.cell_contents is impl for c in meth.__closure__), name
    # the CPU verify takes draft chains; a tree (parent indices) is refused with the flag to use
    tree = dict(
        ssm_states=None, cache_indices=None, query_start_loc=None, intermediate_states_buffer=None,
        intermediate_state_indices=None, cache_steps=4, retrieve_parent_token=torch.zeros(1, 4),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="--speculative-ngram-max-bfs-breadth 1"):
        kt().target_verify(*[None] * 7, **tree)


def test_extra_buffer_track_copy_runs_through_upstreams_entry_point(patched):
    """``track_mamba_states_all_layers`` (what upstream's decode calls under extra_buffer) reaches
    the torch copy: the tracked row's state lands in its track slot in every layer."""
    scatter = patched["sglang.kernels.ops.mamba.mamba_state_scatter_triton"]
    gen = torch.Generator().manual_seed(33)
    conv, ssm = torch.randn(2, 6, 3, 4, generator=gen), torch.randn(2, 6, 2, 2, 2, generator=gen)
    src, dst = torch.tensor([1, 2]), torch.tensor([4, 5])
    mask = torch.tensor([True, False])
    before = conv.clone(), ssm.clone()
    scatter.track_mamba_states_all_layers(conv, ssm, src, mask, dst, 2)
    assert torch.equal(conv[:, 4], before[0][:, 1]) and torch.equal(ssm[:, 4], before[1][:, 1])
    assert torch.equal(conv[:, 5], before[0][:, 5]) and torch.equal(ssm[:, 5], before[1][:, 5])


def test_fused_rmsnorm_gated_module_uses_cpu_path(patched):
    norm = patched["sglang.kernels.ops.attention.fla.fused_norm_gate"]
    gen = torch.Generator().manual_seed(31)
    D = 16
    m = norm.FusedRMSNormGated(D, eps=1e-5, activation="sigmoid")
    with torch.no_grad():
        m.weight.copy_(torch.randn(D, generator=gen))
    x = torch.randn(1, 7, 3, D, generator=gen)
    g = torch.randn(7, 3, D, generator=gen)
    out = m(x.clone(), g)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * m.weight * torch.sigmoid(g)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- backend harness

H, K, V, W = 2, 16, 16, 4
DIM = 2 * H * K + H * V


class _Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_target_verify(self):
        return False

    def is_draft_extend_v2(self):
        return False

    def is_decode(self):
        return self.decode


def _make_backend(mods, conv_pool, ssm_pool):
    kb = mods["sglang.srt.layers.attention.linear.kda_backend"]
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend as LB

    class Backend:
        forward_extend = kb.KDAAttnBackend.forward_extend
        forward_decode = kb.KDAAttnBackend.forward_decode
        _convolve_prefill = kb.KDAAttnBackend._convolve_prefill
        _track_mamba_state_decode = MambaAttnBackendBase._track_mamba_state_decode

    be = Backend()
    be.prefill_graph_metadata = None
    be.accept_lens_pool = None
    be.kernel_dispatcher = kb.KDAKernelDispatcher(LB.TRITON, LB.TRITON, LB.TRITON)
    cache = types.SimpleNamespace(
        conv=[conv_pool], temporal=ssm_pool, replayssm_d=None, replayssm_k=None, replayssm_g=None
    )
    be.req_to_token_pool = types.SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache)
    return be


def _metadata(qsl, slots):
    return types.SimpleNamespace(
        query_start_loc=qsl,
        mamba_cache_indices=slots,
        logical_num_tokens=None,
        has_mamba_track_mask=False,
        track_chunk_idx=None,
        track_ssm_h_src=None,
        state_checkpoint_cu_starts=None,
        num_state_checkpoints=None,
        state_checkpoint_every_n_tokens=None,
        state_checkpoint_indices=None,
        track_ssm_h_batch_src=None,
    )


def _reference(x_tokens, a_tokens, b_tokens, layer):
    """One request's whole stream: direct conv from a zero history, then the naive recurrence."""
    from fla.ops.kda.naive import naive_recurrent_kda

    T = x_tokens.shape[0]
    full = torch.cat([torch.zeros(W - 1, DIM), x_tokens])
    conv = torch.stack([(full[t : t + W].T * layer.conv_weights).sum(1) for t in range(T)])
    conv = F.silu(conv)
    q, k, v = conv.split([H * K, H * K, H * V], -1)
    q = q.view(1, T, H, K)
    k = k.view(1, T, H, K)
    v = v.view(1, T, H, V)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = a_tokens.view(1, T, H, K) + layer.dt_bias.view(H, K)
    g = -torch.exp(layer.A_log.view(H, 1)) * F.softplus(z)
    o, s = naive_recurrent_kda(qn, kn, v, g, torch.sigmoid(b_tokens.view(1, T, H)), output_final_state=True)
    return o[0], s[0], full[-(W - 1) :]


@pytest.mark.parametrize("packed_decode", [True, False])
def test_upstream_kda_backend_extend_and_decode_on_cpu(patched, packed_decode):
    """Two requests: a first extend batch (lengths 70 and 9, no prefix: stale conv state must be
    ignored), a continuation extend of request 0 (prefix 70: conv state and SSM state carried),
    then three decode steps for both. Every output and the final pool contents must equal the
    whole-stream reference."""
    mods = patched
    kt = mods["sglang.srt.layers.attention.linear.kernels.kda_triton"].TritonKDAKernel
    gen = torch.Generator().manual_seed(41)
    layer = types.SimpleNamespace(
        layer_id=0,
        q_dim=H * K,
        k_dim=H * K,
        v_dim=H * V,
        head_q_dim=K,
        head_k_dim=K,
        head_v_dim=V,
        num_v_heads=H,
        num_q_heads=H,
        num_k_heads=H,
        conv_weights=torch.randn(DIM, W, generator=gen) * 0.5,
        bias=None,
        A_log=torch.randn(1, 1, H, 1, generator=gen) * 0.5,
        dt_bias=torch.randn(H * K, generator=gen),
        lower_bound=None,
    )
    slots_n = 5
    conv_pool = torch.randn(slots_n, W - 1, DIM, generator=gen)  # stale garbage in the conv slots
    ssm_pool = torch.randn(slots_n, H, V, K, generator=gen)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    ssm_pool[slots.long()] = 0.0  # the pool zeroes recurrent state for new requests
    untouched = [0, 2, 4]
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    be = _make_backend(mods, conv_pool, ssm_pool)

    saved_flag = kt.supports_packed_decode
    kt.supports_packed_decode = packed_decode
    be.kernel_dispatcher.supports_packed_decode = packed_decode
    try:
        streams_x = [[], []]
        streams_a = [[], []]
        streams_b = [[], []]
        outs = [[], []]

        def extend(reqs, lens, prefix):
            T = sum(lens)
            x = torch.randn(T, DIM, generator=gen)
            a = torch.randn(T, H * K, generator=gen)
            b = torch.randn(T, H, generator=gen)
            qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            be.forward_metadata = _metadata(qsl, slots[reqs])
            fb = types.SimpleNamespace(
                forward_mode=_Mode(False),
                extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                extend_seq_lens_cpu=list(lens),
                mamba_track_mask=None,
            )
            o = be.forward_extend(layer, fb, x, a.view(1, T, H, K), b.unsqueeze(0))
            assert o.shape == (1, T, H, V)
            for i, r in enumerate(reqs):
                s0, s1 = int(qsl[i]), int(qsl[i + 1])
                streams_x[r].append(x[s0:s1])
                streams_a[r].append(a[s0:s1])
                streams_b[r].append(b[s0:s1])
                outs[r].append(o[0, s0:s1])

        extend([0, 1], [70, 9], [0, 0])
        extend([0], [20], [70])
        for _ in range(3):
            x = torch.randn(2, DIM, generator=gen)
            a = torch.randn(2, H * K, generator=gen)
            b = torch.randn(2, H, generator=gen)
            be.forward_metadata = _metadata(torch.arange(3, dtype=torch.int32), slots)
            fb = types.SimpleNamespace(forward_mode=_Mode(True), mamba_track_mask=None)
            o = be.forward_decode(layer, fb, x, a, b.unsqueeze(0))
            assert o.shape == (1, 2, H, V)
            for r in range(2):
                streams_x[r].append(x[r : r + 1])
                streams_a[r].append(a[r : r + 1])
                streams_b[r].append(b[r : r + 1])
                outs[r].append(o[0, r : r + 1])
    finally:
        kt.supports_packed_decode = saved_flag

    for r in range(2):
        o_ref, s_ref, conv_ref = _reference(
            torch.cat(streams_x[r]), torch.cat(streams_a[r]), torch.cat(streams_b[r]), layer
        )
        got = torch.cat(outs[r])
        torch.testing.assert_close(got, o_ref, atol=2e-4, rtol=2e-4, msg=f"outputs req {r}")
        slot = int(slots[r])
        # recurrent state pool layout: [slots, H, V, K] (fla's [H, K, V] transposed)
        torch.testing.assert_close(ssm_pool[slot], s_ref.transpose(-1, -2), atol=2e-4, rtol=2e-4)
        # conv pool layout: [slots, W-1, DIM], the last W-1 pre-conv inputs
        torch.testing.assert_close(conv_pool[slot], conv_ref, atol=0, rtol=0)
    assert torch.equal(conv_pool[untouched], conv0[untouched])
    assert torch.equal(ssm_pool[untouched], ssm0[untouched])
