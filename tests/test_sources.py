"""The source registry: each source's normaliser against its fixture in the real schema, and error naming."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.data import sources
from pipeline.data.conversation import ROLES, ConversationError
from pipeline.run.plan.dag import DATASET_KINDS

# The deliberately malformed rows of each fixture: row index -> the field the error must name.
MALFORMED = {
    "swe-agent": {4: "trajectory[2].role", 9: "trajectory", 13: "trajectory[3].text", 22: "<line>"},
    "deepswe-kimi-k2": {
        3: "messages[2].tool_calls[0].function.name",
        8: "messages[7].role",
        24: "messages[1].content",
    },
    "opencodeinstruct": {5: "output", 12: "input", 23: "input"},
    "magicoder-evol": {2: "response", 10: "instruction", 19: "response"},
    "magicoder-oss": {6: "solution", 15: "problem", 25: "solution"},
    "mixture-of-thoughts": {3: "messages", 11: "messages[1].role", 21: "messages[0].content"},
    "openthoughts": {1: "conversations[0].from", 9: "conversations[0].value", 18: "system"},
    "ultrachat": {6: "messages", 13: "messages[1].content", 22: "messages[0].role"},
    "sharegpt": {2: "conversations[1].from", 10: "conversations", 17: "conversations[0].value"},
    "kimik2-5-2000x": {5: "response", 12: "thinking"},
}
# Well-formed rows that the prep stage refuses for their kind (no user turn to prompt with / no assistant turn).
NO_USER = {"openthoughts": [26], "sharegpt": [25]}
NO_ASSISTANT = {"deepswe-kimi-k2": [16]}


def read_fixture(key: str, tmp_path: Path) -> tuple[dict[int, list[dict]], dict[int, ConversationError]]:
    src = sources.get(key)
    good, bad = {}, {}
    for raw in sources.open_rows(src, str(src.fixture), None, None, {}, tmp_path):
        try:
            if isinstance(raw.row, ConversationError):
                raise raw.row
            good[raw.index] = sources.normalise(src, raw.row, {})
        except ConversationError as exc:
            bad[raw.index] = exc
    return good, bad


def test_the_registry_has_the_ten_sources_each_with_a_fixture_and_a_schema_reference() -> None:
    assert len(sources.SOURCES) == 10
    assert set(MALFORMED) == set(sources.SOURCES)
    for src in sources.SOURCES.values():
        assert src.kind in DATASET_KINDS
        assert src.fixture.is_file(), src.key
        assert src.schema_ref, src.key
        assert src.quota > 0
    kinds = {s.key: s.kind for s in sources.SOURCES.values()}
    assert sorted(k for k, v in kinds.items() if v == "target-native") == [
        "deepswe-kimi-k2",
        "kimik2-5-2000x",
    ]
    assert sum(s.quota for s in sources.SOURCES.values()) == 100_000  # the reference mix


def test_unknown_source_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="unknown source 'ultrachat2'.*ultrachat"):
        sources.get("ultrachat2")


@pytest.mark.parametrize("key", sorted(MALFORMED))
def test_normaliser_accepts_the_good_rows_and_names_the_field_of_each_malformed_one(
    key: str, tmp_path: Path
) -> None:
    good, bad = read_fixture(key, tmp_path)
    assert {i: e.field for i, e in bad.items()} == MALFORMED[key]
    assert len(good) >= 25
    for conv in good.values():
        assert conv and all(t["role"] in ROLES and isinstance(t["content"], str) for t in conv)
    assert [i for i, c in good.items() if not any(t["role"] == "user" for t in c)] == NO_USER.get(key, [])
    assert [i for i, c in good.items() if not any(t["role"] == "assistant" for t in c)] == NO_ASSISTANT.get(
        key, []
    )


def test_swe_agent_maps_ai_turns_to_assistant_and_keeps_observations_as_user(tmp_path: Path) -> None:
    good, _ = read_fixture("swe-agent", tmp_path)
    conv = good[0]
    assert [t["role"] for t in conv] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert conv[0]["content"].startswith("SETTING: You are an autonomous programmer")
    assert "```\nfind_file" in conv[2]["content"]
    assert "ISSUE:" in conv[1]["content"]


def test_tool_trajectory_keeps_tool_calls_and_tool_results(tmp_path: Path) -> None:
    good, _ = read_fixture("deepswe-kimi-k2", tmp_path)
    conv = good[0]
    call = conv[2]["tool_calls"][0]
    assert call["name"] == "execute_bash" and '"command"' in call["arguments"] and call["id"] == "call_0_0"
    assert conv[3] | {"_src": None} == {
        "role": "tool",
        "content": conv[3]["content"],
        "name": "execute_bash",
        "tool_call_id": "call_0_0",
        "_src": None,
    }
    # an assistant turn that only calls a tool has empty text and is still valid
    assert good[1][4]["content"] == "" and good[1][4]["tool_calls"][0]["name"] == "str_replace_editor"


def test_sharegpt_family_maps_roles_and_the_top_level_system(tmp_path: Path) -> None:
    good, _ = read_fixture("openthoughts", tmp_path)
    assert [t["role"] for t in good[0]] == ["system", "user", "assistant"]
    assert good[0][0]["content"].startswith("Your role as an assistant")
    sg, _ = read_fixture("sharegpt", tmp_path)
    assert [t["role"] for t in sg[0]] == ["user", "assistant", "user", "assistant"]
    with_system = next(c for c in sg.values() if c[0]["role"] == "system")
    assert "ChatGPT" in with_system[0]["content"]


def test_flat_sources_map_their_columns(tmp_path: Path) -> None:
    oss, _ = read_fixture("magicoder-oss", tmp_path)
    assert oss[0][0]["content"].startswith("You are working on a small utility library")
    assert oss[0][1]["content"].startswith("The implementation below")
    kimi, _ = read_fixture("kimik2-5-2000x", tmp_path)
    assert kimi[1][1]["reasoning"].startswith("The question asks")
    assert "reasoning" not in kimi[0][1]  # a row whose thinking is null


def test_plan_options_rename_the_columns() -> None:
    src = sources.get("kimik2-5-2000x")
    row = {"question": "2+2?", "answer": "4", "cot": "add"}
    conv = sources.normalise(
        src, row, {"prompt_field": "question", "response_field": "answer", "reasoning_field": "cot"}
    )
    assert (conv[0]["content"], conv[1]["content"], conv[1]["reasoning"]) == ("2+2?", "4", "add")
    with pytest.raises(ConversationError) as err:
        sources.normalise(src, row, {})
    assert err.value.field == "response"


def test_a_broken_jsonl_line_is_one_rejected_row_with_its_line_number(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"instruction": "a", "response": "b"}\n\n{"instruction": "c", "resp\n{"instruction": "d", "response": "e"}\n'
    )
    rows = list(sources.open_rows(sources.get("magicoder-evol"), str(f), None, None, {}, tmp_path / "c"))
    assert [(r.index, r.line) for r in rows] == [(0, 1), (1, 3), (2, 4)]
    assert isinstance(rows[1].row, ConversationError) and "not valid JSON" in rows[1].row.reason
    assert rows[2].row == {"instruction": "d", "response": "e"}
    assert [
        r.index
        for r in sources.open_rows(
            sources.get("magicoder-evol"), str(f), None, None, {}, tmp_path / "c", start=2
        )
    ] == [2]


def test_a_source_without_a_public_hub_id_needs_a_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no public hub id: give the dataset a path"):
        next(sources.open_rows(sources.get("deepswe-kimi-k2"), None, None, None, {}, tmp_path))
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        next(
            sources.open_rows(
                sources.get("ultrachat"), str(tmp_path / "missing.jsonl"), None, None, {}, tmp_path
            )
        )


def test_a_dataset_under_a_long_non_ascii_path_is_read_and_its_cache_stays_there(tmp_path: Path) -> None:
    """``datasets`` names its lock files after the whole cache path, cut to 255 characters, not bytes: a run
    directory such as ``…/é☃…/run/stages/prep.x/out`` gave "File name too long" on every read."""
    deep = tmp_path / ("é☃" * 40) / "run" / "stages" / "prep.chat" / "out"
    deep.mkdir(parents=True)
    f = deep / "d.jsonl"
    f.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "c", "response": "d"}\n')
    rows = list(sources.open_rows(sources.get("magicoder-evol"), str(f), None, None, {}, deep / ".hf-cache"))
    assert [r.row["instruction"] for r in rows] == ["a", "c"]
    assert list((deep / ".hf-cache").iterdir()), (
        "datasets' lock/cache files belong in the stage's own cache dir"
    )
