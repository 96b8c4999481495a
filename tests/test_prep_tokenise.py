"""The shared tokeniser with the real SmolLM2 tokenizer: ids as apply_chat_template gives them, loss masks
exactly on the assistant text, safe truncation, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import sources
from pipeline.data.conversation import ConversationError, trim_to_last_assistant
from pipeline.data.tokenise import ChatTokenizer, load_chat_tokenizer, load_hf_tokenizer

MODEL = "builtin:smollm2-135m-instruct"
EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def hf_tok():  # noqa: ANN201
    return load_hf_tokenizer(MODEL)


@pytest.fixture(scope="module")
def ct(hf_tok) -> ChatTokenizer:  # noqa: ANN001
    return ChatTokenizer(hf_tok, 4096, tokenizer_id=MODEL)


def fixture_convs(key: str, tmp: Path) -> list[list[dict]]:
    src = sources.get(key)
    out = []
    for raw in sources.open_rows(src, str(src.fixture), None, None, {}, tmp):
        try:
            conv = sources.normalise(src, raw.row, {})
            out.append(trim_to_last_assistant(conv))
        except (ConversationError, TypeError):
            continue
    return out


def masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def assistant_texts(ct: ChatTokenizer, conv: list[dict]) -> list[str]:
    """What each assistant turn must contribute: its rendered text plus the end-of-turn token."""
    return [m["content"] + EOT for m in ct.template_messages(conv) if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def chat_convs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    tmp = tmp_path_factory.mktemp("c")
    convs = (
        fixture_convs("deepswe-kimi-k2", tmp)
        + fixture_convs("kimik2-5-2000x", tmp)
        + fixture_convs("ultrachat", tmp)
    )
    convs.append(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "\n\n  leading space and newlines"},
            {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "a"},
        ]
    )
    return convs


def test_ids_are_what_apply_chat_template_gives(ct: ChatTokenizer, hf_tok, chat_convs) -> None:  # noqa: ANN001
    encoded = ct.encode(chat_convs)
    for conv, enc in zip(chat_convs, encoded, strict=True):
        if isinstance(enc, ConversationError):
            assert "special token" in enc.reason  # the one fixture row carrying <|im_end|> in its text
            continue
        ref = hf_tok.apply_chat_template(ct.template_messages(conv), tokenize=True, return_dict=False)
        assert enc.input_ids.tolist() == list(ref)


def test_loss_mask_covers_exactly_the_assistant_turns(ct: ChatTokenizer, hf_tok, chat_convs) -> None:  # noqa: ANN001
    checked = 0
    for conv, enc in zip(chat_convs, ct.encode(chat_convs), strict=True):
        if isinstance(enc, ConversationError):
            continue
        runs = [hf_tok.decode(r) for r in masked_runs(enc.input_ids, enc.loss_mask)]
        expected = assistant_texts(ct, conv)
        assert len(runs) == len(expected)
        for got, want in zip(runs, expected, strict=True):
            # a token that straddles the header/content boundary (a leading newline) is counted in
            assert got == want or (got.endswith(want) and got[: -len(want)].isspace()), (got, want)
        # and nothing else: the unmasked tokens hold no assistant text
        rest = hf_tok.decode(
            [t for t, m in zip(enc.input_ids.tolist(), enc.loss_mask.tolist(), strict=True) if not m]
        )
        for want in expected:
            assert want.strip() not in rest
        checked += 1
    assert checked >= 50


def test_tool_calls_and_reasoning_are_folded_into_the_masked_text(ct: ChatTokenizer, hf_tok) -> None:  # noqa: ANN001
    conv = [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "use ls",
            "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls"}'}],
        },
        {"role": "tool", "content": "a.py", "tool_call_id": "c1"},
        {"role": "assistant", "content": "There is a.py."},
    ]
    (enc,) = ct.encode([conv])
    runs = [hf_tok.decode(r) for r in masked_runs(enc.input_ids, enc.loss_mask)]
    assert runs == [
        '<think>\nuse ls\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
        + EOT,
        "There is a.py." + EOT,
    ]


def test_truncation_keeps_the_first_max_length_tokens_of_the_whole_text(hf_tok) -> None:  # noqa: ANN001
    ct64 = ChatTokenizer(hf_tok, 64, tokenizer_id=MODEL)
    code = "\n".join(f"def f{i}(x):\n    return x * {i}  # {'word ' * (i % 7)}" for i in range(400))
    convs = [
        [{"role": "user", "content": "write code " * k}, {"role": "assistant", "content": code}]
        for k in (1, 8, 90)
    ]
    sparse = (
        "y" + " " * 40 + "z\n"
    ) * 300  # ~7 characters per token: the first cut is too short and is retried
    convs.append([{"role": "user", "content": "pad"}, {"role": "assistant", "content": sparse}])
    convs.append(
        [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]
    )  # no safe cut
    for conv, enc in zip(convs, ct64.encode(convs), strict=True):
        full = hf_tok.apply_chat_template(ct64.template_messages(conv), tokenize=True, return_dict=False)
        assert enc.truncated and enc.num_tokens == 64
        assert enc.input_ids.tolist() == list(full)[:64]
    # the long user turn leaves no room for the reply: nothing to learn from
    assert [e.target_tokens > 0 for e in ct64.encode(convs)] == [True, True, False, True, False]


def test_special_tokens_inside_text_are_refused_naming_the_source_field(ct: ChatTokenizer) -> None:
    src = sources.get("kimik2-5-2000x")
    conv = sources.normalise(src, {"problem": "q", "response": "fine<|im_end|>\n<|im_start|>user\nmore"}, {})
    (err,) = ct.encode([conv])
    assert isinstance(err, ConversationError)
    assert err.field == "response" and "<|im_end|>" in err.reason
    call = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "bash", "arguments": {"cmd": "echo '<|im_start|>'"}}],
        },
    ]
    (err,) = ct.encode([call])
    assert isinstance(err, ConversationError) and err.field == "messages[1].tool_calls[0]"


def test_prefix_method_for_slow_tokenizers_masks_the_same_text(ct: ChatTokenizer, hf_tok, chat_convs) -> None:  # noqa: ANN001
    slow = ChatTokenizer(hf_tok, 4096, tokenizer_id=MODEL, method="prefix")
    assert slow.method == "prefix"
    sample = chat_convs[:12]
    for a, b in zip(ct.encode(sample), slow.encode(sample), strict=True):
        if isinstance(a, ConversationError):
            assert isinstance(b, ConversationError)
            continue
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()


def test_a_tokenizer_without_a_chat_template_is_refused(hf_tok) -> None:  # noqa: ANN001
    class NoTemplate:
        chat_template = None
        name_or_path = "plain-tokenizer"

    with pytest.raises(ValueError, match="plain-tokenizer.*no chat template"):
        ChatTokenizer(NoTemplate(), 128)


def test_load_chat_tokenizer_records_the_plan_id_and_a_template_hash() -> None:
    ct = load_chat_tokenizer(MODEL, 256)
    assert ct.tokenizer_id == MODEL and ct.method == "offsets" and len(ct.template_hash) == 16
    assert json.dumps(ct.template_kwargs) == "{}"


def test_a_template_that_refuses_a_prefix_gives_a_row_error_not_a_crash(hf_tok) -> None:  # noqa: ANN001
    import copy

    strict = copy.deepcopy(hf_tok)
    strict.chat_template = hf_tok.chat_template.replace(
        "{% for message in messages %}",
        "{% if add_generation_prompt and messages|length > 1 %}{{ raise_exception('no prefixes') }}{% endif %}"
        "{% for message in messages %}",
    )
    ct = ChatTokenizer(strict, 128, tokenizer_id="strict")
    convs = [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ],
    ]
    ok, bad = ct.encode(convs)
    assert ok.target_tokens > 0
    assert isinstance(bad, ConversationError) and "chat template failed on a prefix" in bad.reason
