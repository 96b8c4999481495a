"""Issue 15 item 8: end-of-turn and pad ids come from the chat template and generation config, not ``tok.eos_token_id``.

The GGUF conversion of the demo model is run for real (transformers' own GGUF loader). transformers 5.17 (the
GPU image) writes ``eos_token = "<|im_start|>"`` and no pad token where 5.24 (here) writes ``<|im_end|>``;
the 5.17 result is reproduced on the real converted tokenizer by setting exactly those two fields.
"""

from __future__ import annotations

import copy

import pytest

from pipeline.data import token_facts
from pipeline.data.model_assets import fix_turn_tokens, load_tokenizer, smollm2_gguf, turn_tokens
from tests.eagle3_fixtures import MODEL


@pytest.fixture(scope="module")
def gguf_pair():  # noqa: ANN201
    """The bundled GGUF's tokenizer, and its model as far as these tests read it: the config and the generation
    config transformers derives from the GGUF's metadata (what ``from_pretrained`` sets on the model when the
    GGUF has no generation_config.json). Not the weights: de-quantizing them took 20 of the 30 CPU-seconds."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    g = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    config = AutoConfig.from_pretrained(str(g.parent), gguf_file=g.name)
    model = SimpleNamespace(config=config, generation_config=GenerationConfig.from_model_config(config))
    return tok, model


def as_517(tok):  # noqa: ANN001, ANN201
    """What transformers 5.17's GGUF conversion leaves: eos = the turn *opener*, no pad."""
    t = copy.deepcopy(tok)
    t.eos_token = "<|im_start|>"
    t.pad_token = None
    return t


def test_the_end_of_turn_is_what_the_chat_template_closes_the_answer_with(gguf_pair) -> None:
    tok, model = gguf_pair
    im_end, im_start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    for t in (tok, as_517(tok)):
        facts = token_facts.resolve(t, None)
        assert facts.end_of_turn == [im_end], t.eos_token
        assert im_start in facts.turn_openers and im_start not in facts.stop_ids
        assert facts.sources["end_of_turn"] == "chat template"
    bad = as_517(tok)
    assert bad.eos_token_id == im_start  # the trap: trusting this would stop on the next turn's opener
    assert token_facts.resolve(bad, None).pad == im_end  # no pad token: the end-of-turn id pads


def test_a_generation_config_naming_the_opener_is_not_believed(gguf_pair) -> None:
    tok, model = gguf_pair
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = [tok.convert_tokens_to_ids("<|im_start|>"), 7]
    gen.pad_token_id = None
    facts = token_facts.resolve(as_517(tok), gen)
    assert facts.end_of_turn == [tok.convert_tokens_to_ids("<|im_end|>"), 7]


def test_the_converted_demo_folder_stops_on_im_end_whatever_the_converter_wrote(gguf_pair) -> None:
    tok, model = gguf_pair
    t, m = as_517(tok), copy.deepcopy(model)
    m.generation_config.eos_token_id = t.convert_tokens_to_ids("<|im_start|>")
    fix_turn_tokens(t, m)
    assert t.eos_token == "<|im_end|>" and t.pad_token == "<|im_end|>"
    assert m.generation_config.eos_token_id == t.convert_tokens_to_ids("<|im_end|>")
    folder = load_tokenizer(MODEL)  # the cached folder every stage and the CPU server use
    assert turn_tokens(MODEL).end_of_turn == [folder.convert_tokens_to_ids("<|im_end|>")]


def test_no_template_no_config_and_an_opener_for_eos_is_a_clear_error(gguf_pair) -> None:
    tok, _ = gguf_pair
    t = as_517(tok)
    t.chat_template = None
    facts = token_facts.resolve(
        t, None
    )  # without a template there are no known openers: the eos is used, and said so
    assert "tokenizer eos_token" in facts.sources["end_of_turn"]
    t.eos_token = None
    with pytest.raises(token_facts.TokenFactsError, match="no end-of-turn token"):
        token_facts.resolve(t, None)


def test_a_template_that_drops_the_answer_is_refused(gguf_pair) -> None:
    tok, _ = gguf_pair
    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{{ m['role'] }}\n{% endfor %}"
    with pytest.raises(token_facts.TokenFactsError, match="drops the assistant's content"):
        token_facts.resolve(t, None)
