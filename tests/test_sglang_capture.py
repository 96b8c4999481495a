"""The layers SGLang feeds a draft, per model family: Aerie's table against SGLang's own code.

SGLang's model modules cannot be imported without a GPU stack, so each family's real
``set_eagle3_layers_to_capture`` is taken from the installed sglang's source and run on a stand-in
``self`` (the attributes it touches). For Llama-class and DeepSeek/Kimi-class targets, with the
default and custom aux lists, the ids Aerie writes into the draft config must make SGLang capture
the inputs of ``aux + 1`` — the outputs the draft was trained on — and Aerie must read the same aux
layers back from the config.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.eagle3.draft_config import DraftConfig, DraftModelError, default_aux_layers, sglang_capture_ids
from pipeline.serving import sglang_capture as sc

# (sglang model file, class, an architecture it serves, aux lists to try on a 61-layer target)
FAMILIES = [
    ("llama.py", "LlamaForCausalLM", "LlamaForCausalLM"),
    ("qwen2.py", "Qwen2ForCausalLM", "Qwen2ForCausalLM"),
    ("deepseek_v2.py", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    ("kimi_k25.py", "KimiK25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
]
AUX_LISTS = [default_aux_layers(61), [2, 30, 58], [1, 29, 57], [5, 20, 40]]


def _sglang_models() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "sglang is not installed here; install it for this test with "
            "`pip install --no-deps -r .ci/sglang-parser-requirements.txt`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"


def _method(file: Path, cls: str) -> Any:
    """SGLang's own ``cls.set_eagle3_layers_to_capture``, compiled from its source on its own."""
    tree = ast.parse(file.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(
        n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture"
    )
    ns: dict[str, Any] = {"Optional": Any, "List": list}
    exec(compile(textwrap.dedent(ast.unparse(fn)), str(file), "exec"), ns)
    return ns["set_eagle3_layers_to_capture"]


def _capture(models: Path, file: str, cls: str, config_ids: list[int]) -> list[int]:
    """What SGLang hooks (``model.layers_to_capture``) for these config ids, by its own method."""
    deepseek = _method(models / "deepseek_v2.py", "DeepseekV2ForCausalLM")

    def stand_in() -> SimpleNamespace:
        return SimpleNamespace(
            pp_group=SimpleNamespace(is_last_rank=True),
            config=SimpleNamespace(num_hidden_layers=61),
            model=SimpleNamespace(layers_to_capture=None),
        )

    me = stand_in()
    if cls == "KimiK25ForConditionalGeneration":  # its language model is SGLang's DeepseekV3ForCausalLM
        lm = stand_in()
        me.language_model = SimpleNamespace(set_eagle3_layers_to_capture=lambda ids: deepseek(lm, ids))
        _method(models / file, cls)(me, config_ids)
        return list(lm.model.layers_to_capture)
    _method(models / file, cls)(me, config_ids)
    return list(me.model.layers_to_capture)


@pytest.mark.parametrize("file,cls,arch", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_sglang_feeds_the_draft_the_layers_it_was_trained_on(file: str, cls: str, arch: str) -> None:
    models = _sglang_models()
    for aux in AUX_LISTS:
        written = DraftConfig(
            hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
            vocab_size=10, draft_vocab_size=10, aux_layer_ids=aux, target_hidden_size=8,
            target_architecture=arch,
        ).sglang_config()  # fmt: skip
        ids = written["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        hooked = _capture(models, file, cls, ids)
        assert hooked == [a + 1 for a in aux], (cls, aux, ids)  # the inputs of aux+1: the outputs of aux
        assert written["eagle_config"]["sglang_layers_to_capture"] == hooked  # what Aerie tells the operator
        assert DraftConfig.from_sglang_config(written).aux_layer_ids == aux  # and reads back


def test_the_deepseek_rule_is_the_one_the_issue_found() -> None:
    """A Kimi draft on aux [2, 30, 58] written as-is would be fed the outputs of [1, 29, 57]."""
    assert sc.fed_outputs([2, 30, 58], "KimiK25ForConditionalGeneration") == [1, 29, 57]
    assert sc.fed_outputs([2, 30, 58], "LlamaForCausalLM") == [2, 30, 58]
    assert sc.config_layer_ids([2, 30, 58], "KimiK25ForConditionalGeneration") == [3, 31, 59]
    assert sglang_capture_ids([1, 29, 57], "DeepseekV3ForCausalLM") == [2, 30, 58]


def test_aux_layer_0_cannot_be_served_on_a_deepseek_class_target() -> None:
    with pytest.raises(DraftModelError, match="aux layer 0 cannot be served on DeepseekV3ForCausalLM"):
        sglang_capture_ids([0, 30, 58], "DeepseekV3ForCausalLM")
    assert sglang_capture_ids([0, 30, 58], "LlamaForCausalLM") == [1, 31, 59]


def test_a_wrapper_config_names_the_class_sglang_picks() -> None:
    kimi = SimpleNamespace(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25")
    text = SimpleNamespace(architectures=None, model_type="deepseek_v3")
    assert sc.architecture_of(kimi) == "KimiK25ForConditionalGeneration"
    assert sc.architecture_of(text) == "DeepseekV3ForCausalLM"
    assert sc.architecture_of(SimpleNamespace(model_type="llama")) is None  # the plus-one rule
