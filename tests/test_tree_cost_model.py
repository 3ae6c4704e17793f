"""Byte and FLOP model sanity, against the numbers in DESIGN.md."""

import pytest

from sglang_k3.cache import preset

MiB = 1 << 20


def test_kimi_linear_state_and_kv_sizes():
    c = preset("kimi-linear-48b")
    assert (c.num_kda_layers, c.num_mla_layers) == (20, 7)
    assert c.recurrent_bytes("fp32") == 40 * MiB
    assert c.kv_bytes_per_token("bf16") == 1152 * 7
    assert c.recurrent_bytes("bf16") == 20 * MiB
    # int8: one byte per element plus an fp32 scale per (head, k)
    assert c.recurrent_bytes("int8") == 10 * MiB + 20 * 32 * 128 * 4
    assert c.conv_bytes() == 20 * 32 * 3 * 128 * 3 * 2
    assert c.checkpoint_bytes() == c.recurrent_bytes() + c.conv_bytes()


def test_presets_shapes():
    t, k3 = preset("tiny"), preset("k3")
    assert (t.hidden, t.num_kda_layers, t.num_mla_layers, t.kda_head_k) == (256, 6, 2, 64)
    assert (k3.num_layers, k3.num_kda_layers, k3.num_mla_layers, k3.num_experts, k3.top_k) == (93, 69, 24, 896, 16)


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-48b", "k3"])
def test_prefill_flops_additive_and_superlinear(name):
    c = preset(name)
    assert c.prefill_flops(0, 0) == 0
    whole = c.prefill_flops(0, 4096)
    assert whole == pytest.approx(c.prefill_flops(0, 1000) + c.prefill_flops(1000, 4096))
    # the same span costs more after a longer prefix (MLA attention term)
    assert c.prefill_flops(8192, 8256) > c.prefill_flops(0, 64) > 0


def test_active_params_order_of_magnitude():
    # linear FLOPs per token ~ 2 x activated params: Kimi-Linear activates ~3B
    c = preset("kimi-linear-48b")
    per_token = c.prefill_flops(0, 1) / 2
    assert 1.5e9 < per_token < 4e9


def test_cost_model_from_the_embedded_models_config():
    """The server prices eviction with the served model's own dimensions."""
    from sglang_k3.cache.cost_model import from_hf_config
    from sglang_k3.model.tiny_spec import TinyK3Spec

    spec = TinyK3Spec()
    c = from_hf_config(spec.hf_config())
    assert (c.num_kda_layers, c.num_mla_layers) == (6, 2)
    assert (c.kda_heads, c.kda_head_k, c.moe_intermediate, c.top_k) == (4, 64, 128, 2)
    # recurrent fp32 state: 6 layers x 4 heads x 64 x 64 x 4 B
    assert c.recurrent_bytes("fp32") == 6 * 4 * 64 * 64 * 4
    assert c.prefill_flops(0, 128) > c.prefill_flops(64, 128) > 0
