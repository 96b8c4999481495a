"""Reasoning kept (issue 25 item 3): with Kimi-K2.5's own chat template, the final answer is trained as the
model generated it — its reasoning inside the loss mask — and earlier turns as the template renders them at
serving time (their reasoning dropped: ``<think></think>answer``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.data.tokenise import ChatTokenizer
from tests.kimi_fixture import build_tiny_tokenizer

TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning": "Two and two make four."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "It is 6.", "reasoning": "Three and three make six, so six."},
]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(tmp_path_factory.mktemp("kimi-tok")))
    )


def _trained_text(ct: ChatTokenizer, conv: list[dict]) -> tuple[str, str]:
    enc = ct.encode([conv])[0]
    assert not isinstance(enc, Exception), enc
    tok = ct.tokenizer
    return tok.decode(enc.input_ids), tok.decode(enc.input_ids[enc.loss_mask == 1])


def test_the_final_answers_reasoning_is_trained_as_kimi_generated_it(kimi_tokenizer: object) -> None:
    ct = ChatTokenizer(kimi_tokenizer, 512, tokenizer_id="kimi")
    text, trained = _trained_text(ct, TWO_TURNS)
    # The second turn as the model wrote it after the generation prompt "<|im_assistant|>assistant<|im_middle|><think>".
    assert text.endswith("<think>Three and three make six, so six.</think>It is 6.<|im_end|>"), text
    assert "Three and three make six" in trained and "It is 6." in trained  # reasoning inside the loss mask
    # The first turn as the template renders a past turn at serving time: its reasoning dropped.
    assert "Two and two make four" not in text and "<think></think>It is 4.<|im_end|>" in text
    assert "It is 4." in trained
    assert "What is 2 + 2?" not in trained and "And 3 + 3?" not in trained  # prompts are not trained


def test_rendering_the_finished_conversation_would_have_thrown_the_reasoning_away(
    kimi_tokenizer: object,
) -> None:
    """What prep did before: the template given the whole conversation keeps no reasoning at all."""
    ct = ChatTokenizer(kimi_tokenizer, 512, tokenizer_id="kimi")
    assert "Three and three" not in ct.render(ct.template_messages(TWO_TURNS))


def test_thinking_off_trains_no_reasoning(kimi_tokenizer: object) -> None:
    """A dataset whose target answered with thinking off (options.thinking = false): no reasoning exists to keep."""
    ct = ChatTokenizer(kimi_tokenizer, 512, tokenizer_id="kimi", template_kwargs={"thinking": False})
    text, trained = _trained_text(ct, TWO_TURNS)
    assert "Three and three" not in text and text.endswith("<think></think>It is 6.<|im_end|>")
    assert "It is 6." in trained


def test_a_template_that_keeps_reasoning_is_rendered_as_it_was() -> None:
    """SmolLM2's template has no reasoning field: reasoning is folded into the answer text, as before."""
    from pipeline.data.tokenise import load_chat_tokenizer

    ct = load_chat_tokenizer("builtin:smollm2-135m-instruct", 512)
    assert ct.generation_tail is None
    text, trained = _trained_text(ct, TWO_TURNS[:2])
    assert (
        "Two and two make four." in trained
        and text == ct.render(ct.template_messages(TWO_TURNS[:2]))[: len(text)]
    )


def test_a_dataset_says_whether_its_target_thinks(tmp_path: Path) -> None:
    from pipeline.run.plan import dag as plan_mod
    from pipeline.run.plan.sections import RegenSection

    def plan(thinking: str) -> Path:
        p = tmp_path / "p.toml"
        p.write_text(
            '[run]\nname = "r"\ndir = "run"\n[prep]\ntemplate_kwargs = {x = 1}\n'
            '[[datasets]]\nname = "chat"\nsource = "ultrachat"\nkind = "prompt-only"\nquota = 1\n'
            f"options = {{{thinking}}}\n"
            '[[stage]]\nid = "a"\ncommand = "true"\n'
        )
        return p

    assert plan_mod.load(plan("thinking = false")).template_kwargs("chat") == {"x": 1, "thinking": False}
    assert plan_mod.load(plan("")).template_kwargs("chat") == {"x": 1}  # unset: the model's own default
    with pytest.raises(plan_mod.PlanError, match=r"datasets\[0\]\.options\.thinking: expected true or false"):
        plan_mod.load(plan('thinking = "yes"'))
    # regen asks the server for the same mode it will train on
    assert RegenSection().sampling_body(thinking=False)["chat_template_kwargs"] == {"thinking": False}
    assert "chat_template_kwargs" not in RegenSection().sampling_body()
