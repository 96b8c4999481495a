"""Which target layers SGLang hooks for an EAGLE-3 draft: its rule per model family, for the pinned release.

A draft is trained on the *outputs* of target layers ``aux`` (0-based). SGLang feeds the draft the
*inputs* of the layers in ``layers_to_capture``, which each model class derives from the draft config's
``eagle_config.eagle_aux_hidden_state_layer_ids`` in its ``set_eagle3_layers_to_capture``. In SGLang 0.5.14 and 0.5.23:

* most families (Llama, Qwen2/3, Qwen3-MoE, GPT-OSS, GLM-4-MoE, MiniMax, Gemma 3/4 ...) capture
  ``id + 1`` for every id: the output of layer ``id``;
* the DeepSeek-V2/V3 class (``deepseek_v2.py``: DeepSeek-V2/V3/V3.2, Kimi-K2, and Kimi-K2.5, whose
  language model is a DeepSeek-V3) and GLM-4-MoE-Lite add 1 **only when the first id is 1**; any other
  list is captured as written — the outputs of ``id - 1``.

So the ids Aerie writes depend on the target's architecture: for the DeepSeek class with a first aux layer
other than 1 it writes ``aux + 1`` (captured as written); a first aux layer 0 cannot be expressed there at
all (``[1, ...]`` would be shifted again) and is refused. ``tests/test_sglang_capture.py`` runs SGLang's own
``set_eagle3_layers_to_capture`` of each family (taken from the installed sglang's source) against this table.
"""

from __future__ import annotations

SGLANG_RELEASE = "0.5.14"  # the GPU lock's release; 0.5.23's rule is the same code (tests/test_sglang_api.py)
# Architectures whose set_eagle3_layers_to_capture adds 1 only when the first id is 1.
FIRST_ID_ONE = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Glm4MoeLiteForCausalLM",
    }
)


# When a config carries no ``architectures`` (a wrapper's text config): its model_type says the class.
_BY_MODEL_TYPE = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}


def architecture_of(cfg: object) -> str | None:
    """The model class SGLang will pick for a target config: ``architectures[0]``, else by model_type."""
    archs = getattr(cfg, "architectures", None)
    if isinstance(archs, list | tuple) and archs and isinstance(archs[0], str):
        return archs[0]
    return _BY_MODEL_TYPE.get(str(getattr(cfg, "model_type", "")))


class CaptureError(ValueError):
    """Aux layers SGLang cannot be told to capture for this target."""


def shifts_only_from_one(architecture: str | None) -> bool:
    return architecture in FIRST_ID_ONE


def config_layer_ids(aux: list[int], architecture: str | None) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make SGLang feed the outputs of layers ``aux``."""
    if not shifts_only_from_one(architecture) or not aux or aux[0] == 1:
        return list(aux)
    if aux[0] == 0:
        raise CaptureError(
            f"aux layer 0 cannot be served on {architecture}: SGLang {SGLANG_RELEASE} captures the listed "
            "layers' inputs and adds 1 only when the first id is 1, so no id list feeds layer 0's output; "
            "start the aux layers at 1 or later"
        )
    return [i + 1 for i in aux]


def layers_to_capture(config_ids: list[int], architecture: str | None) -> list[int]:
    """The layers whose *input* SGLang hooks for these config ids (its ``layers_to_capture``)."""
    if shifts_only_from_one(architecture) and (not config_ids or config_ids[0] != 1):
        return list(config_ids)
    return [i + 1 for i in config_ids]


def fed_outputs(config_ids: list[int], architecture: str | None) -> list[int]:
    """The layers whose *output* SGLang feeds the draft for these config ids: what it must be trained on."""
    return [i - 1 for i in layers_to_capture(config_ids, architecture)]
