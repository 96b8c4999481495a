"""The dataset source registry: how each public source is loaded and turned into a canonical conversation.

One :class:`Source` entry per source says where the data lives on the hub (id, config, split, data files),
which field holds the turns, the source's usual kind (``target-native`` sources already hold the target
model's replies; ``prompt-only`` ones get them regenerated), a suggested quota, the normaliser, and the
public page the schema was read from. Adding a source is one entry (plus a fixture in its real schema under
``pipeline/fixtures/datasets/``, and, for a new layout, a normaliser in :mod:`pipeline.data.normalisers`).

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
from pipeline.data.normalisers import (
    norm_messages,
    norm_pair,
    norm_reasoning_trace,
    norm_sharegpt,
    norm_swe_agent,
    norm_tool_trajectory,
    type_name,
)

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
        raise ConversationError("<row>", f"expected an object, got {type_name(row)}")
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
