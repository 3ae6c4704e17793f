"""The two methods an EAGLE / EAGLE3 draft asks of its target, on ``KimiLinearForCausalLM``.

SGLang 0.5.23's EAGLE worker (``speculative/eagle_worker_v2.py``, ``init_lm_head``) shares the
target's input embedding and LM head with the draft through
``speculative/pp_draft_embedding.resolve_target_embed_and_head``, which calls
``target_model.get_embed_and_head()``; and an EAGLE3 target is told which layers' hidden states
to hand the draft by ``configure_aux_hidden_state_capture``
(``model_executor/model_runner_components/attention_backend_setup.py``), which calls
``model.set_eagle3_layers_to_capture(layer_ids)`` and refuses a model without it.
``KimiLinearForCausalLM`` has neither. ``HookRegistry`` wraps attributes that exist and cannot add
one, so this hook runs after the model's ``__init__`` and binds both to the instance (SGLang looks
them up on the model object: ``hasattr(model, ...)``, ``target_model.get_embed_and_head()``).

* ``get_embed_and_head``: ``(model.embed_tokens.weight, lm_head.weight)``, as ``LlamaForCausalLM``
  returns them. On a pipeline stage without the embedding (``PPMissingLayer``) the attribute error
  is what ``resolve_target_embed_and_head`` expects there.
* ``set_eagle3_layers_to_capture``: KimiLinear already captures aux hidden states for DSPARK
  (``set_dspark_layers_to_capture``: the residual stream after each listed layer, returned with the
  final hidden states and passed to its ``LogitsProcessor``); EAGLE3 uses that path. EAGLE3's ids
  name the layer whose *output* is captured (``LlamaForCausalLM`` adds one because its layers capture
  their *input*), so they are the DSPARK ids unchanged. Without ids (a draft config with no
  ``eagle_aux_hidden_state_layer_ids``) Llama's default, the inputs of layers ``[2, n // 2, n - 3]``,
  is the outputs of ``[1, n // 2 - 1, n - 4]``.
"""

from __future__ import annotations

TARGET = "sglang.srt.models.kimi_linear.KimiLinearForCausalLM.__init__"
REASON = "EAGLE/EAGLE3 call get_embed_and_head and set_eagle3_layers_to_capture on the target; KimiLinear has neither"
UPSTREAM_VERSION = "0.5.23"
CPU_ONLY = False


def default_layer_ids(num_layers: int) -> list[int]:
    """Llama's default EAGLE3 capture (inputs of layers 2, n // 2, n - 3) as the layers whose
    output is captured."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def get_embed_and_head(self):
    return self.model.embed_tokens.weight, self.lm_head.weight


def set_eagle3_layers_to_capture(self, layer_ids=None) -> None:
    n = int(self.config.num_hidden_layers)
    ids = default_layer_ids(n) if layer_ids is None else [int(i) for i in layer_ids]
    if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
        raise ValueError(
            f"EAGLE3 aux hidden-state layers {ids}: KimiLinearForCausalLM has {n} layers and captures each "
            "listed layer's output once: give distinct ids in [0, n) (eagle_config.eagle_aux_hidden_state_layer_ids "
            "of the draft's config)"
        )
    if self.pp_group.world_size > 1:
        raise NotImplementedError("EAGLE3 aux hidden-state capture on KimiLinearForCausalLM with pipeline parallelism")
    self.set_dspark_layers_to_capture(ids)


def bind_draft_methods(result, self, *args, **kwargs):
    import types

    self.get_embed_and_head = types.MethodType(get_embed_and_head, self)
    self.set_eagle3_layers_to_capture = types.MethodType(set_eagle3_layers_to_capture, self)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, bind_draft_methods, HookType.AFTER)
