"""EAGLE / EAGLE3 with a KimiLinear target (issue #34), the parts that run on CPU.

* which speculative algorithms the k3 cache serves where (``check_speculative``, ``launch_server``,
  the unified-memory patch's switch);
* ``patches/kimi_linear_eagle`` on SGLang's own ``KimiLinearForCausalLM``, built in-process for
  the embedded tiny model (one gloo rank, no server) and reached through SGLang's own call sites:
  ``resolve_target_embed_and_head`` (what the EAGLE worker's ``init_lm_head`` calls) and
  ``configure_aux_hidden_state_capture`` (what the model runner calls for EAGLE3). The forward's
  aux capture itself (KimiLinear's DSPARK path) needs attention backends and pools: the GPU run
  covers it (benchmarks/gpu_serving.sh spec, SPEC_ALGO);
* ``sglang_k3.model.tiny_draft``: its files load into SGLang's ``LlamaForCausalLMEagle`` /
  ``LlamaForCausalLMEagle3`` (``load_weights``, which skips unknown names silently: every
  parameter not shared with the target must come from the file, and every tensor of the file
  must land in one).

Serving with EAGLE on CPU (the draft's ops in torch, chains of one or more draft steps) is tested against
real servers in ``tests/test_speculative_eagle_server.py``.
"""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from sglang_k3.integration.k3_args import check_speculative


def test_check_speculative_decisions():
    for algo in ("EAGLE", "EAGLE3", "eagle3"):
        check_speculative(algo, cpu=False)  # topk unset: SGLang picks 1 for this model
        check_speculative(algo, cpu=False, eagle_topk=1)
        check_speculative(algo, cpu=False, eagle_topk="1")
        with pytest.raises(ValueError, match=f"--speculative-algorithm {algo} --speculative-eagle-topk 4: .*chains"):
            check_speculative(algo, cpu=False, eagle_topk=4)
        for cpu in (False, True):  # chains of any length, on CPU too (a torch-native draft backend a step)
            check_speculative(algo, cpu=cpu, eagle_topk=1, eagle_steps=1, eagle_draft_tokens=2)
            check_speculative(algo, cpu=cpu, eagle_topk=1, eagle_steps=3, eagle_draft_tokens=4)
            check_speculative(algo, cpu=cpu, eagle_steps="3")
        wrong_width = "--speculative-num-steps 3 --speculative-num-draft-tokens 3: .*draft-tokens 4"
        with pytest.raises(ValueError, match=wrong_width):
            check_speculative(algo, cpu=True, eagle_topk=1, eagle_steps=3, eagle_draft_tokens=3)
        for bad in ("three", "0"):  # on a GPU too: the reason, not int()'s message
            with pytest.raises(ValueError, match=f"--speculative-num-steps {bad}: the draft steps a verify must be"):
                check_speculative(algo, cpu=False, eagle_steps=bad, eagle_draft_tokens=4)
    for cpu in (False, True):
        with pytest.raises(ValueError, match="NEXTN: the k3 cache does not serve with it: .*no MTP/NextN layer"):
            check_speculative("NEXTN", cpu=cpu)
        with pytest.raises(ValueError, match="STANDALONE: the k3 cache does not serve with it"):
            check_speculative("STANDALONE", cpu=cpu)
        check_speculative("NGRAM", cpu=cpu, ngram_breadth=1)
        check_speculative(None, cpu=cpu)


def test_launch_server_serves_eagle_over_fixed_pools_and_chains_on_cpu(monkeypatch, capsys):
    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: False)
    argv = ["--model-path", "/m", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"]
    out, cfg = L.build_argv(argv)  # none of the three chain flags: SGLang picks them
    assert out[out.index("--speculative-algorithm") + 1] == "EAGLE3" and "/d" in out
    assert "--speculative-eagle-topk" not in out and "--speculative-num-steps" not in out
    assert not cfg.unified_memory
    assert "a draft model's KV pool is sized from SGLang's own" in capsys.readouterr().err
    # the steps alone (SGLang stopped on them with a TypeError): the chain's topk and width follow
    out, cfg = L.build_argv(argv + ["--speculative-num-steps", "3"])
    assert [out[out.index(f) + 1] for f in ("--speculative-eagle-topk", "--speculative-num-draft-tokens")] == ["1", "4"]
    assert "with the k3 cache: --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in capsys.readouterr().err
    # a topk without the steps (SGLang: a bare AssertionError): refused with what to give
    with pytest.raises(SystemExit, match="without --speculative-num-steps: give the draft steps too"):
        L.build_argv(argv + ["--speculative-eagle-topk", "1"])
    with pytest.raises(SystemExit, match="--speculative-eagle-topk 2: the k3 cache serves EAGLE with draft chains"):
        L.build_argv(argv + ["--speculative-eagle-topk", "2"])
    with pytest.raises(SystemExit, match="--speculative-eagle-topk 2: the k3 cache serves EAGLE with draft chains"):
        L.build_argv(argv + ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2"])
    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)
    out, cfg = L.build_argv(argv)  # on CPU: a chain of one draft step, set where not given
    for flag, value in (("--speculative-num-steps", "1"), ("--speculative-eagle-topk", "1")):
        assert out[out.index(flag) + 1] == value
    assert out[out.index("--speculative-num-draft-tokens") + 1] == "2"
    assert "on CPU: --speculative-num-steps 1" in capsys.readouterr().err
    out, cfg = L.build_argv(argv + ["--speculative-num-steps", "3"])  # more steps: the chain's verify width follows
    assert out[out.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "--speculative-num-steps" not in capsys.readouterr().err  # given, not set
    with pytest.raises(SystemExit, match="draft-tokens 5: a draft chain of 3 tokens is verified as 4"):
        L.build_argv(argv + ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "5"])
    for bad in ("three", "0", "-2"):  # the width steps + 1 is derived from it: refused with the reason first
        with pytest.raises(SystemExit, match=f"--speculative-num-steps {bad}: the draft steps a verify must be"):
            L.build_argv(argv + ["--speculative-num-steps", bad])


def test_unified_memory_stays_off_with_a_draft_model():
    """Started another way (unified memory on in the k3 config), the pools stay SGLang's when a
    draft model shares the target's allocator."""
    from sglang_k3.config import K3Config
    from sglang_k3.patches.kv_cache_configurator_init_pools import wanted

    cfg = K3Config()
    assert cfg.unified_memory

    def sa(algo):
        return SimpleNamespace(radix_cache_backend="k3", disable_radix_cache=False, speculative_algorithm=algo)

    assert wanted(sa(None), cfg) and wanted(sa("NGRAM"), cfg)
    assert not wanted(sa("EAGLE"), cfg) and not wanted(sa("eagle3"), cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sglang_cpu():
    """SGLang's runtime context for one CPU rank: dummy server args, gloo groups, ranks 0."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_context, get_parallel

    override = get_context().override_server_args(device="cpu")
    override.install()
    if not torch.distributed.is_initialized():
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    ranks = ("tp", "pp", "moe_ep", "moe_dp", "moe_tp", "attn_tp", "attn_cp", "dcp", "attn_dcp", "attn_dp", "dp")
    get_parallel().override_permanently(**{f"{r}_rank": 0 for r in ranks}, launch_world_rank=0)
    yield
    override.restore()


@pytest.fixture(scope="module")
def kimi(sglang_cpu):
    """SGLang's KimiLinearForCausalLM for the embedded model, with patches/kimi_linear_eagle
    applied through HookRegistry (and taken off again afterwards)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.kimi_linear import KimiLinearForCausalLM
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_k3.model.tiny_build import default_model_path
    from sglang_k3.patches import kimi_linear_eagle

    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    original_init = KimiLinearForCausalLM.__dict__["__init__"]
    HookRegistry.reset()
    try:
        kimi_linear_eagle.register()
        HookRegistry.apply_hooks()
        assert KimiLinearForCausalLM.__init__ is not original_init
        torch.manual_seed(0)
        model = KimiLinearForCausalLM(ModelConfig(default_model_path()).hf_config)
        yield model
    finally:
        KimiLinearForCausalLM.__init__ = original_init
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


def test_target_embed_and_head_reach_the_draft_through_sglangs_resolver(kimi):
    from sglang.srt.speculative.pp_draft_embedding import resolve_target_embed_and_head

    embed, head = resolve_target_embed_and_head(kimi)
    assert embed is kimi.model.embed_tokens.weight and head is kimi.lm_head.weight
    assert embed.shape == head.shape and embed.shape[1] == kimi.config.hidden_size
    assert embed.shape[0] >= kimi.config.vocab_size  # VocabParallelEmbedding pads the rows


def test_eagle3_capture_is_configured_through_sglangs_call_site(kimi):
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )

    def configure(layer_ids):
        configure_aux_hidden_state_capture(
            model=kimi,
            eagle_use_aux_hidden_state=True,
            eagle_aux_hidden_state_layer_ids=layer_ids,
            dflash_use_aux_hidden_state=False,
            dflash_target_layer_ids=None,
            is_dspark=False,
        )

    assert kimi.model.dspark_layers_to_capture is None and not kimi.capture_aux_hidden_states
    n = kimi.config.num_hidden_layers
    assert n == 8
    configure([0, 5, 7])  # EAGLE3's ids name the layers whose output the draft takes
    assert kimi.capture_aux_hidden_states and kimi.model.dspark_layers_to_capture == [0, 5, 7]
    configure(None)  # Llama's default: the inputs of layers 2, n // 2, n - 3
    assert kimi.model.dspark_layers_to_capture == [1, n // 2 - 1, n - 4] == [1, 3, 4]
    for bad in ([1, 1, 2], [0, n]):
        with pytest.raises(ValueError, match=f"KimiLinearForCausalLM has {n} layers"):
            configure(bad)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_draft_builder_output_loads_into_sglangs_draft_class(sglang_cpu, tmp_path, kind):
    from safetensors import safe_open
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from transformers import LlamaConfig

    from sglang_k3.model.tiny_build import default_model_path
    from sglang_k3.model.tiny_draft import KINDS, build_draft

    target = default_model_path()
    out = build_draft(target, str(tmp_path / kind), kind)
    with open(os.path.join(target, "config.json")) as f:
        tcfg = json.load(f)
    cfg = LlamaConfig.from_pretrained(out)
    assert cfg.architectures == [KINDS[kind]] and cfg.hidden_size == tcfg["hidden_size"]
    if kind == "eagle":
        from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle as cls

        shared = {"model.embed_tokens.weight", "lm_head.weight"}  # set_embed_and_head from the target
    else:
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as cls

        shared = {"model.embed_tokens.weight"}  # set_embed from the target (same hidden size)
        assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    model = cls(cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    model.load_weights(safetensors_weights_iterator([os.path.join(out, "model.safetensors")]))
    missing = sorted(n for n, p in params.items() if n not in shared and not bool(p.abs().sum() > 0))
    assert missing == []
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        written = sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    # every written tensor landed in a parameter, and nothing else was written (ParallelLMHead
    # pads its rows to a multiple of 64: the padding is not in a checkpoint)
    rows = {"lm_head.weight": cfg.vocab_size}
    assert written == sum(p[: rows.get(n)].numel() for n, p in params.items() if n not in shared)
    if kind == "eagle":
        assert model.model.fc.weight.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
        assert not hasattr(model.model.layers[0], "input_layernorm")
    else:
        assert model.model.fc.weight.shape == (cfg.hidden_size, 3 * tcfg["hidden_size"])
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape[1] == 2 * cfg.hidden_size
        assert model.lm_head.org_vocab_size == tcfg["vocab_size"] and not model.load_lm_head_from_target
