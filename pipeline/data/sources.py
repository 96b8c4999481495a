"""The dataset source registry: how each public source is loaded and turned into a canonical conversation.

One :class:`Source` entry per source says where the data lives on the hub (id, config, split, data files),
which field holds the turns, the source's usual kind (``target-native`` sources already hold the target
model's replies; ``prompt-only`` ones get them regenerated), a suggested quota, the normaliser, and the
public page the schema was read from. Adding a source is one entry (plus a fixture in its real schema under
``pipeline/fixtures/datasets/``).

Rows are read with ``datasets`` (:func:`open_rows`): streaming from the hub, or from a local file named by
the plan's ``path`` (``.jsonl`` is read line by line so that one broken line is one rejected row, not a
failed load; ``.json``/``.parquet`` through the matching ``datasets`` builder). A normaliser takes one raw
row and the plan's ``options`` and returns a canonical conversation (see :mod:`pipeline.data.tokenise`), or
raises :class:`~pipeline.data.conversation.ConversationError` naming the source field that is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data.conversation import ConversationError, check_conversation

FIXTURES = Path(__file__).parent / "fixtures" / "datasets"
Row = dict[str, Any]
Normaliser = Callable[[Row, dict[str, Any]], list[dict[str, Any]]]


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    kind: str  # the usual kind; the plan's [[datasets]].kind decides
    quota: int  # suggested share of the ~100K-sample reference mix
    hub: str | None  # hub dataset id (None: give the plan a path or options.hub)
    conv_field: str  # the field that holds the turns, for error messages
    normalise: Normaliser
    schema_ref: str  # the public page the schema was read from
    split: str = "train"
    config: str | None = None
    data_files: str | None = None
    notes: str = ""

    @property
    def fixture(self) -> Path:
        return FIXTURES / f"{self.key}.jsonl"


# --------------------------------------------------------------------------------------------
# Field helpers: every error names the source's own field path.
def _type_name(v: Any) -> str:
    return "nothing (missing or null)" if v is None else type(v).__name__


def need_text(obj: Row, key: str, where: str = "", allow_empty: bool = False) -> str:
    path = f"{where}.{key}" if where else key
    v = obj.get(key)
    if not isinstance(v, str):
        raise ConversationError(path, f"expected text, got {_type_name(v)}")
    if not allow_empty and not v.strip():
        raise ConversationError(path, "empty text")
    return v


def need_list(obj: Row, key: str) -> list[Any]:
    v = obj.get(key)
    if not isinstance(v, list):
        raise ConversationError(key, f"expected a list of turns, got {_type_name(v)}")
    if not v:
        raise ConversationError(key, "empty list of turns")
    return v


def turns(
    row: Row, field: str, role_key: str, text_key: str, role_map: dict[str, str]
) -> list[dict[str, Any]]:
    """``row[field]`` as canonical turns, mapping the source's role names (unknown roles are errors)."""
    out = []
    for i, t in enumerate(need_list(row, field)):
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise ConversationError(where, f"expected a turn object, got {_type_name(t)}")
        raw_role = t.get(role_key)
        if raw_role not in role_map:
            raise ConversationError(
                f"{where}.{role_key}", f"unknown role {raw_role!r} (known: {', '.join(role_map)})"
            )
        out.append(
            {
                "role": role_map[raw_role],
                "content": need_text(t, text_key, where),
                "_src": {"content": f"{where}.{text_key}"},
            }
        )
    return out


MESSAGE_ROLES = {r: r for r in ("system", "user", "assistant", "tool")}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}


# --------------------------------------------------------------------------------------------
# Normalisers
def norm_messages(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages: [{role, content}]`` (UltraChat, Mixture-of-Thoughts)."""
    return turns(row, opts.get("field", "messages"), "role", "content", MESSAGE_ROLES)


def norm_sharegpt(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """``conversations: [{from, value}]`` with ShareGPT role names; an optional top-level ``system``."""
    conv = turns(row, opts.get("field", "conversations"), "from", "value", SHAREGPT_ROLES)
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise ConversationError("system", f"expected text, got {_type_name(system)}")
        if system.strip() and conv[0]["role"] != "system":
            conv.insert(0, {"role": "system", "content": system, "_src": {"content": "system"}})
    return conv


def norm_pair(prompt: str, response: str) -> Normaliser:
    """Single-turn instruction/response columns."""

    def normalise(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
        pf, rf = opts.get("prompt_field", prompt), opts.get("response_field", response)
        return [
            {"role": "user", "content": need_text(row, pf), "_src": {"content": pf}},
            {"role": "assistant", "content": need_text(row, rf), "_src": {"content": rf}},
        ]

    normalise.__doc__ = f"``{prompt}`` -> user, ``{response}`` -> assistant."
    return normalise


def norm_swe_agent(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """nebius SWE-agent: ``trajectory: [{role: system|user|ai, text, system_prompt, mask, cutoff_date}]``.

    Observations come back as ``user`` turns and actions are ``ai`` text with a fenced command, so the
    canonical form is plain system/user/assistant text.
    """
    roles = {"system": "system", "user": "user", "ai": "assistant"}
    out = []
    for i, t in enumerate(need_list(row, "trajectory")):
        where = f"trajectory[{i}]"
        if not isinstance(t, dict):
            raise ConversationError(where, f"expected a turn object, got {_type_name(t)}")
        role = t.get("role")
        if role not in roles:
            raise ConversationError(f"{where}.role", f"unknown role {role!r} (known: {', '.join(roles)})")
        key = "text"
        if role == "system" and not (isinstance(t.get("text"), str) and t["text"].strip()):
            key = "system_prompt"  # some rows keep the prompt only here
        out.append(
            {"role": roles[role], "content": need_text(t, key, where), "_src": {"content": f"{where}.{key}"}}
        )
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ConversationError(where, f"expected a tool call object, got {_type_name(call)}")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ConversationError(f"{where}.function", f"expected an object, got {_type_name(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}.function.name", f"expected a tool name, got {_type_name(name)}")
    args = fn.get("arguments")
    if not isinstance(args, str | dict):
        raise ConversationError(
            f"{where}.function.arguments", f"expected a JSON string or object, got {_type_name(args)}"
        )
    out = {"name": name, "arguments": args}
    if isinstance(call.get("id"), str) and call["id"]:
        out["id"] = call["id"]
    return out


def norm_tool_trajectory(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI-style agent trajectory: ``[{role, content, tool_calls: [{id, type, function: {name, arguments}}],
    tool_call_id, name}]``; an assistant turn may have empty content when it only calls tools."""
    field = opts.get("field", "messages")
    out = []
    for i, t in enumerate(need_list(row, field)):
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise ConversationError(where, f"expected a turn object, got {_type_name(t)}")
        role = t.get("role")
        if role not in MESSAGE_ROLES:
            raise ConversationError(
                f"{where}.role", f"unknown role {role!r} (known: {', '.join(MESSAGE_ROLES)})"
            )
        raw_calls = t.get("tool_calls")
        if raw_calls is not None and not isinstance(raw_calls, list):
            raise ConversationError(f"{where}.tool_calls", f"expected a list, got {_type_name(raw_calls)}")
        calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls or [])]
        if role == "assistant" and calls:
            content = t.get("content")
            if content is None:
                content = ""
            elif not isinstance(content, str):
                raise ConversationError(f"{where}.content", f"expected text, got {_type_name(content)}")
        else:
            content = need_text(t, "content", where)
        src = {
            "content": f"{where}.content",
            **{f"tool_calls[{j}]": f"{where}.tool_calls[{j}].function" for j in range(len(calls))},
        }
        turn: dict[str, Any] = {"role": role, "content": content, "_src": src}
        if calls:
            turn["tool_calls"] = calls
        if role == "tool":
            for k in ("name", "tool_call_id"):
                if isinstance(t.get(k), str) and t[k]:
                    turn[k] = t[k]
        out.append(turn)
    return out


def norm_reasoning_trace(row: Row, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat distilled-reasoning columns: ``problem`` -> user, ``thinking`` + ``response`` -> assistant."""
    pf, rf, tf = (
        opts.get("prompt_field", "problem"),
        opts.get("response_field", "response"),
        opts.get("reasoning_field", "thinking"),
    )
    turn: dict[str, Any] = {
        "role": "assistant",
        "content": need_text(row, rf),
        "_src": {"content": rf, "reasoning": tf},
    }
    thinking = row.get(tf)
    if thinking is not None:
        if not isinstance(thinking, str):
            raise ConversationError(tf, f"expected text, got {_type_name(thinking)}")
        if thinking.strip():
            turn["reasoning"] = thinking
    return [{"role": "user", "content": need_text(row, pf), "_src": {"content": pf}}, turn]


# --------------------------------------------------------------------------------------------
_HF = "https://huggingface.co/datasets/"
_ALL = [
    Source(
        "swe-agent",
        "SWE-agent trajectories (nebius)",
        "prompt-only",
        15_000,
        "nebius/SWE-agent-trajectories",
        "trajectory",
        norm_swe_agent,
        _HF + "nebius/SWE-agent-trajectories (dataset_info in README.md)",
        notes="roles system/user/ai; actions are fenced commands in ai text, observations are user turns",
    ),
    Source(
        "deepswe-kimi-k2",
        "DeepSWE agent trajectories by Kimi-K2",
        "target-native",
        5_000,
        None,
        "messages",
        norm_tool_trajectory,
        "not published; OpenAI tool-call trajectory layout as in "
        + _HF
        + "nvidia/SWE-Zero-openhands-trajectories and nebius/SWE-rebench-openhands-trajectories",
        notes="give the plan a path (or options.hub); options.field names the turns column",
    ),
    Source(
        "opencodeinstruct",
        "OpenCodeInstruct (NVIDIA)",
        "prompt-only",
        12_000,
        "nvidia/OpenCodeInstruct",
        "input",
        norm_pair("input", "output"),
        _HF + "nvidia/OpenCodeInstruct (dataset card, fields)",
    ),
    Source(
        "magicoder-evol",
        "Magicoder Evol-Instruct 110K",
        "prompt-only",
        8_000,
        "ise-uiuc/Magicoder-Evol-Instruct-110K",
        "instruction",
        norm_pair("instruction", "response"),
        _HF + "ise-uiuc/Magicoder-Evol-Instruct-110K (dataset viewer)",
    ),
    Source(
        "magicoder-oss",
        "Magicoder OSS-Instruct 75K",
        "prompt-only",
        8_000,
        "ise-uiuc/Magicoder-OSS-Instruct-75K",
        "problem",
        norm_pair("problem", "solution"),
        _HF + "ise-uiuc/Magicoder-OSS-Instruct-75K (dataset viewer)",
    ),
    Source(
        "mixture-of-thoughts",
        "Mixture-of-Thoughts (open-r1)",
        "prompt-only",
        15_000,
        "open-r1/Mixture-of-Thoughts",
        "messages",
        norm_messages,
        _HF + "open-r1/Mixture-of-Thoughts (dataset_info: messages, num_tokens, source)",
        config="all",
        notes="configs: all, code, math, science",
    ),
    Source(
        "openthoughts",
        "OpenThoughts-114k",
        "prompt-only",
        12_000,
        "open-thoughts/OpenThoughts-114k",
        "conversations",
        norm_sharegpt,
        _HF + "open-thoughts/OpenThoughts-114k (system, conversations[{from, value}])",
    ),
    Source(
        "ultrachat",
        "UltraChat 200k",
        "prompt-only",
        12_000,
        "HuggingFaceH4/ultrachat_200k",
        "messages",
        norm_messages,
        _HF + "HuggingFaceH4/ultrachat_200k (README: prompt, prompt_id, messages)",
        split="train_sft",
    ),
    Source(
        "sharegpt",
        "ShareGPT Vicuna unfiltered",
        "prompt-only",
        11_000,
        "Aeala/ShareGPT_Vicuna_unfiltered",
        "conversations",
        norm_sharegpt,
        "https://huggingface.co/datasets/RyokoAI/ShareGPT52K (id, conversations"
        "[{from: human|gpt, value}]); Aeala's copy is one JSON array",
        data_files="ShareGPT_V4.3_unfiltered_cleaned_split.json",
        notes="roles human/gpt, also system/bing/chatgpt/bard; other roles are rejected",
    ),
    Source(
        "kimik2-5-2000x",
        "Kimi-K2.5 distilled reasoning (2000x)",
        "target-native",
        2_000,
        None,
        "problem",
        norm_reasoning_trace,
        _HF + "bmeyer2025/kimi-reasoning-traces (id, source, problem, expected_answer, "
        "thinking, response, teacher, thinking_tokens); the 2000x set's own columns are not published",
        notes="options prompt_field / response_field / reasoning_field rename the columns",
    ),
]
SOURCES: dict[str, Source] = {s.key: s for s in _ALL}


def get(key: str) -> Source:
    try:
        return SOURCES[key]
    except KeyError:
        raise KeyError(f"unknown source {key!r} (known: {', '.join(SOURCES)})") from None


def normalise(src: Source, row: Any, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Raw row -> checked canonical conversation, or :class:`ConversationError`."""
    if not isinstance(row, dict):
        raise ConversationError("<row>", f"expected an object, got {_type_name(row)}")
    return check_conversation(src.normalise(row, options), field=src.conv_field)


# --------------------------------------------------------------------------------------------
# Loading
@dataclass
class RawRow:
    index: int  # 0-based position in the source (for a .jsonl file: among its non-blank lines)
    row: Any  # the decoded row, or a ConversationError when it could not be decoded
    line: int | None = None  # 1-based line number in a local .jsonl file


def describe(
    src: Source, path: str | None, split: str | None, config: str | None, options: dict[str, Any]
) -> dict:
    """Where the rows come from, as recorded in manifests and fingerprints."""
    if path:
        return {"path": str(path)}
    hub = options.get("hub", src.hub)
    return {
        "hub": hub,
        "config": config or src.config,
        "split": split or src.split,
        "data_files": options.get("data_files", src.data_files),
        "revision": options.get("revision"),
    }


def open_rows(
    src: Source,
    path: str | None,
    split: str | None,
    config: str | None,
    options: dict[str, Any],
    cache_dir: Path,
    start: int = 0,
) -> Iterator[RawRow]:
    """Rows of the source from index ``start`` on, read with ``datasets`` (streaming; nothing is downloaded
    up front). ``cache_dir`` receives the ``datasets`` lock/cache files so nothing is written elsewhere."""
    fd = None
    try:
        fd, cache = _short_cache_path(cache_dir)
        yield from _open_rows(src, path, split, config, options, cache, start)
    finally:
        if fd is not None:
            os.close(fd)


def _short_cache_path(cache_dir: Path) -> tuple[int | None, str]:
    """A short ASCII name for ``cache_dir``: ``/proc/self/fd/N`` on an open descriptor of it, where Linux has one.

    ``datasets`` names its lock files after the whole cache path and shortens that name to 255 *characters*,
    so a run directory whose path holds non-ASCII characters (``é``, ``☃``) gives a name of more than 255
    *bytes* and every read fails with ``File name too long``. Through the descriptor the files still land in
    ``cache_dir``, inside the run directory."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not os.path.isdir("/proc/self/fd"):
        return None, str(cache_dir)
    fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
    return fd, f"/proc/self/fd/{fd}"


def _open_rows(
    src: Source,
    path: str | None,
    split: str | None,
    config: str | None,
    options: dict[str, Any],
    cache_dir: str,
    start: int,
) -> Iterator[RawRow]:
    import datasets

    datasets.disable_progress_bars()
    if path:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{p}: dataset file not found")
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            ds = datasets.load_dataset(
                "text", data_files=str(p), split="train", streaming=True, cache_dir=cache_dir
            )
            index = 0
            for line_no, rec in enumerate(ds, start=1):
                text = rec["text"]
                if not text.strip():
                    continue
                if index >= start:
                    try:
                        row: Any = json.loads(text)
                    except ValueError as exc:
                        row = ConversationError("<line>", f"not valid JSON: {exc}")
                    yield RawRow(index, row, line_no)
                index += 1
            return
        builder = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}.get(suffix)
        if builder is None:
            raise ValueError(
                f"{p}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet, .arrow or .csv)"
            )
        ds = datasets.load_dataset(
            builder, data_files=str(p), split="train", streaming=True, cache_dir=cache_dir
        )
    else:
        where = describe(src, None, split, config, options)
        if not where["hub"]:
            raise ValueError(
                f"source {src.key!r} has no public hub id: give the dataset a path or options.hub"
            )
        kw: dict[str, Any] = {"split": where["split"], "streaming": True, "cache_dir": cache_dir}
        if where["data_files"]:
            kw["data_files"] = where["data_files"]
        if where["revision"]:
            kw["revision"] = where["revision"]
        ds = datasets.load_dataset(where["hub"], where["config"], **kw)
    if start:
        ds = ds.skip(start)
    for i, row in enumerate(ds, start=start):
        yield RawRow(i, row)
