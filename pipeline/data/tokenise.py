"""Shared tokenising and shard I/O: canonical conversations -> target-tokenised, loss-masked Parquet shards.

Both the prep stage (target-native sources) and the regeneration stage (conversations whose replies the
target model rewrote) go through this module, so "what a training row is" is defined exactly once.
Nothing here reads a plan or emits events; callers do that.

Canonical conversation
    A list of turns, each a dict::

        {"role": "system" | "user" | "assistant" | "tool", "content": str}
        assistant turns may add  "reasoning": str                      (a thinking trace)
                                 "tool_calls": [{"name": str, "arguments": str | dict, "id"?: str}]
        tool turns may add       "name": str, "tool_call_id": str
        any turn may add         "_src": {"content": "messages[3].value", ...}: where its text came from in
                                 the source row, so errors name the source's own field (never hashed/rendered)

    :func:`check_conversation` validates one and raises :class:`ConversationError` naming the turn and
    field; :func:`conversation_hash` is the exact-duplicate key; :func:`prompt_of` cuts a conversation
    down to its prompt (everything up to and including the last user turn, as ``{role, content}``).

Tokenising (:class:`ChatTokenizer`)
    ``ct = ChatTokenizer(hf_tokenizer, max_length, tokenizer_id="builtin:...")`` then
    ``ct.encode(conversations)`` returns, per conversation, an :class:`Encoded` (``input_ids`` int32,
    ``loss_mask`` int8, both numpy, at most ``max_length`` long) or a :class:`ConversationError`.

    The conversation is rendered once with the tokenizer's own chat template. Each assistant turn's
    character span is found by rendering the prefix up to it (with the generation prompt) and the prefix
    including it; the span runs from the end of the assistant header through the template's end-of-turn
    marker (trailing whitespace excluded), so tool calls and reasoning the template renders inside the
    turn are covered. With a fast tokenizer the rendered text is tokenised once, in a batch, with offsets,
    and a token is in the mask when its characters overlap a span (the rule transformers uses for
    ``return_assistant_tokens_mask``); a slow tokenizer falls back to incremental prefix tokenisation.
    Text far beyond ``max_length`` tokens is cut before tokenising, at a point where the tokenizer's
    pre-tokenisation cannot change (a newline between two non-space characters), so the kept tokens are
    identical to tokenising the whole text. Templates that do not mention ``tool_calls`` /
    ``reasoning_content`` get those folded into the content as ``<tool_call>{json}</tool_call>`` /
    ``<think>...</think>`` text; templates that do are given OpenAI-style ``tool_calls`` with the
    arguments as the source had them (JSON text or object) and ``reasoning_content``. A text holding
    one of the tokenizer's special tokens (``<|im_end|>``) is refused: it would silently end the turn.

Shards (:class:`ShardStore`)
    Numbered Parquet files ``data-00000.parquet`` written atomically (temp file, fsync, rename) with the
    ``datasets`` features of :func:`features` ``("tokenized")`` (id, input_ids list<int32>, loss_mask
    list<int8>, num_tokens int32) or ``("prompts")`` (id, messages list<{role, content}>). After each shard
    its record ``progress/data-00000.json`` (rows, tokens, sha256, the caller's resume state and the
    run's *fingerprint*) is written atomically; :meth:`ShardStore.finished` returns the verified prefix
    of finished shards, so a retry skips them. ``manifest.json`` is written last; its presence with the
    same fingerprint means the whole output is done. The on-disk format is described in
    docs/data-formats.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.rundir import read_json, write_atomic, write_json

ROLES = ("system", "user", "assistant", "tool")
FORMAT_VERSION = 1
SHARD_PREFIX = "data-"
# A cut is safe after "\n" with non-space on both sides: every pre-tokenizer in use (ByteLevel regex,
# Metaspace, Split on whitespace) ends a piece there, so the tokens before it cannot change.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_CHARS_PER_TOKEN_GUESS = 4  # most text has 3-4.5; denser text (CJK, digits) costs one retry at twice the length
_CUT_MARGIN_TOKENS = 16


class ConversationError(ValueError):
    """A conversation (or source row) that cannot be used, naming the field and why."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


class StaleOutputError(RuntimeError):
    """The output directory holds shards made with different settings."""


# --------------------------------------------------------------------------------------------
# Canonical conversations
def source_field(turn: dict[str, Any], key: str, fallback: str) -> str:
    """The source row's field a turn's ``key`` came from (``_src``), else ``fallback``."""
    src = turn.get("_src")
    return src.get(key, fallback) if isinstance(src, dict) else fallback


def check_conversation(conv: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Validate a canonical conversation; returns it, or raises :class:`ConversationError`."""
    if not isinstance(conv, list) or not conv:
        raise ConversationError(field, "expected a non-empty list of turns")
    for i, turn in enumerate(conv):
        key = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise ConversationError(key, f"expected a turn object, got {type(turn).__name__}")
        role = turn.get("role")
        if role not in ROLES:
            raise ConversationError(f"{key}.role", f"unknown role {role!r} (known: {', '.join(ROLES)})")
        content = turn.get("content")
        if not isinstance(content, str):
            raise ConversationError(source_field(turn, "content", f"{key}.content"),
                                    f"expected text, got {type(content).__name__}")
        calls = turn.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ConversationError(f"{key}.tool_calls", f"only assistant turns carry tool calls, not {role}")
            if not isinstance(calls, list):
                raise ConversationError(f"{key}.tool_calls", "expected a list")
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
                    raise ConversationError(f"{key}.tool_calls[{j}].name", "a tool call needs a name")
                if not isinstance(call.get("arguments"), str | dict):
                    raise ConversationError(f"{key}.tool_calls[{j}].arguments", "expected a JSON string or object")
        reasoning = turn.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ConversationError(source_field(turn, "reasoning", f"{key}.reasoning"),
                                    f"expected text, got {type(reasoning).__name__}")
        if not content.strip() and not calls:
            raise ConversationError(source_field(turn, "content", f"{key}.content"), "empty text")
    return conv


def conversation_hash(conv: Sequence[dict[str, Any]]) -> str:
    """The exact-duplicate key: a hash of the canonical JSON of the turns (``_``-keys left out)."""
    plain = [{k: v for k, v in t.items() if not k.startswith("_")} for t in conv]
    raw = json.dumps(plain, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def fold_tool_calls(turn: dict[str, Any]) -> str:
    """An assistant turn's content with its tool calls appended as ``<tool_call>{json}</tool_call>``."""
    parts = [turn["content"]] if turn.get("content") else []
    for call in turn.get("tool_calls") or ():
        args = call.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        parts.append("<tool_call>\n" + json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False)
                     + "\n</tool_call>")
    return "\n".join(parts)


def prompt_of(conv: Sequence[dict[str, Any]], field: str = "messages") -> list[dict[str, str]]:
    """The prompt to regenerate from: turns up to and including the last user turn, as ``{role, content}``.

    Earlier assistant tool calls are folded into their text; reasoning traces of other models are dropped.
    """
    last_user = max((i for i, t in enumerate(conv) if t["role"] == "user"), default=-1)
    if last_user < 0:
        raise ConversationError(field, "no user turn to build a prompt from")
    out = []
    for t in conv[: last_user + 1]:
        content = fold_tool_calls(t) if t.get("tool_calls") else t["content"]
        out.append({"role": t["role"], "content": content})
    return out


def trim_to_last_assistant(conv: Sequence[dict[str, Any]], field: str = "messages") -> list[dict[str, Any]]:
    """Drop turns after the last assistant turn (they carry no loss); raise if there is none."""
    last = max((i for i, t in enumerate(conv) if t["role"] == "assistant"), default=-1)
    if last < 0:
        raise ConversationError(field, "no assistant turn to learn from")
    first = next(i for i, t in enumerate(conv) if t["role"] != "system")
    if conv[first]["role"] == "assistant":
        raise ConversationError(f"{field}[{first}].role", "the conversation starts with an assistant turn")
    return list(conv[: last + 1])


# --------------------------------------------------------------------------------------------
# Tokenising
@dataclass
class Encoded:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 on assistant tokens
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def target_tokens(self) -> int:
        return int(self.loss_mask.sum())


def template_hash(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16]


class ChatTokenizer:
    """Renders canonical conversations with a tokenizer's chat template and tokenises them with a loss mask."""

    def __init__(self, tokenizer: Any, max_length: int, tokenizer_id: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, method: str = "auto") -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError(f"tokenizer {tokenizer_id or tokenizer.name_or_path!r} has no chat template")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.tokenizer_id = tokenizer_id or str(tokenizer.name_or_path)
        self.template = template
        self.template_hash = template_hash(template)
        self.template_kwargs = dict(template_kwargs or {})
        self.native_tool_calls = "tool_calls" in template
        self.native_reasoning = "reasoning_content" in template
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if method not in ("auto", "offsets", "prefix"):
            raise ValueError(f"method must be auto, offsets or prefix, got {method!r}")
        if method == "offsets" and backend is None:
            raise ValueError("method 'offsets' needs a fast tokenizer")
        self._backend = backend if method in ("auto", "offsets") else None
        self.method = "offsets" if self._backend is not None else "prefix"
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._compiled = self._compile()

    # -- rendering --------------------------------------------------------------------------
    def _compile(self) -> Any:
        """The compiled template, when rendering it directly matches ``apply_chat_template`` (it is faster)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            return None
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}]
        kw = {**self.tokenizer.special_tokens_map, **self.template_kwargs}
        try:
            compiled = _compile_jinja_template(self.template)
            for msgs, gen in ((probe, False), (probe[:2], True)):
                mine = compiled.render(messages=msgs, tools=None, documents=None, add_generation_prompt=gen, **kw)
                ref = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen,
                                                         **self.template_kwargs)
                if mine != ref:
                    return None
        except Exception:  # an unusual template: always go through apply_chat_template
            return None
        return compiled

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for already-converted template messages (see :meth:`template_messages`)."""
        if self._compiled is not None:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.tokenizer.special_tokens_map, **self.template_kwargs)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def template_messages(self, conv: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonical turns -> what the chat template expects (native or folded tool calls / reasoning)."""
        out: list[dict[str, Any]] = []
        for t in conv:
            m: dict[str, Any] = {"role": t["role"], "content": t["content"]}
            if t["role"] == "assistant":
                if t.get("tool_calls"):
                    if self.native_tool_calls:
                        m["tool_calls"] = [
                            {"id": c.get("id") or f"call_{i}", "type": "function",
                             "function": {"name": c["name"], "arguments": c["arguments"]}}
                            for i, c in enumerate(t["tool_calls"])
                        ]
                    else:
                        m["content"] = fold_tool_calls(t)
                if t.get("reasoning"):
                    if self.native_reasoning:
                        m["reasoning_content"] = t["reasoning"]
                    else:
                        m["content"] = f"<think>\n{t['reasoning']}\n</think>\n\n{m['content']}"
            elif t["role"] == "tool":
                for k in ("name", "tool_call_id"):
                    if t.get(k):
                        m[k] = t[k]
            out.append(m)
        return out

    def _check_specials(self, conv: Sequence[dict[str, Any]], field: str) -> None:
        if self._specials is None:
            return
        for i, t in enumerate(conv):
            texts = [(key, t.get(key)) for key in ("content", "reasoning")]
            for j, call in enumerate(t.get("tool_calls") or ()):
                args = call.get("arguments")
                texts.append((f"tool_calls[{j}]", call["name"] + (args if isinstance(args, str) else json.dumps(args))))
            for key, text in texts:
                if isinstance(text, str) and (m := self._specials.search(text)):
                    raise ConversationError(source_field(t, key, f"{field}[{i}].{key}"),
                                            f"contains the special token {m.group(0)!r}")

    def _spans(self, msgs: list[dict[str, Any]], rendered: str, limit: int, field: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns that start before ``limit``."""
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head = self.render(msgs[:i], add_generation_prompt=True)
            if not rendered.startswith(head):
                raise ConversationError(f"{field}[{i}]", "the chat template renders this turn's history differently "
                                        "from the whole conversation; cannot locate the assistant text")
            if len(head) >= limit:
                break
            full = self.render(msgs[: i + 1])
            if not rendered.startswith(full):
                raise ConversationError(f"{field}[{i}]", "the chat template renders this turn differently inside "
                                        "the whole conversation; cannot locate the assistant text")
            end = len(full.rstrip())
            if end > len(head):
                spans.append((len(head), end))
        return spans

    def _cut(self, text: str, budget: int) -> str:
        """``text`` cut at the first safe point past ``budget`` characters (or whole)."""
        if len(text) <= budget:
            return text
        m = _SAFE_CUT.search(text, budget)
        return text[: m.start()] if m else text

    def _tokenise(self, texts: list[str]) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        """(token count, ids, offsets) per text, ids/offsets cut to max_length + margin before leaving Rust."""
        keep = self.max_length + _CUT_MARGIN_TOKENS
        if self._backend is not None:
            out = []
            for e in self._backend.encode_batch(texts, add_special_tokens=False):
                n = len(e)
                if n > keep:
                    e.truncate(keep)
                out.append((n, np.asarray(e.ids, dtype=np.int32), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)))
            return out
        res = []
        for t in texts:
            ids = self.tokenizer.encode(t, add_special_tokens=False)
            res.append((len(ids), np.asarray(ids[:keep], dtype=np.int32), None))
        return res

    def encode(self, convs: Sequence[Sequence[dict[str, Any]]], field: str = "messages") -> list[Encoded | ConversationError]:
        """Tokenise conversations (canonical, checked, ending with an assistant turn) with loss masks."""
        out: list[Encoded | ConversationError | None] = [None] * len(convs)
        rendered: dict[int, tuple[list[dict[str, Any]], str]] = {}
        for k, conv in enumerate(convs):
            try:
                self._check_specials(conv, field)
                msgs = self.template_messages(conv)
                rendered[k] = (msgs, self.render(msgs))
            except ConversationError as exc:
                out[k] = exc
            except Exception as exc:  # a template error (raise_exception in the template, a bad value)
                out[k] = ConversationError(field, f"chat template failed: {type(exc).__name__}: {exc}")
        budget = self.max_length * _CHARS_PER_TOKEN_GUESS
        todo = list(rendered)
        tokens: dict[int, tuple[np.ndarray, np.ndarray | None, int]] = {}
        while todo:
            texts = [self._cut(rendered[k][1], budget) for k in todo]
            retry = []
            for k, text, (n, ids, offs) in zip(todo, texts, self._tokenise(texts), strict=True):
                if len(text) < len(rendered[k][1]) and n < self.max_length + _CUT_MARGIN_TOKENS:
                    retry.append(k)  # the guess of characters per token was too low for this text
                else:
                    tokens[k] = (ids, offs, len(text))
            todo, budget = retry, budget * 2
        for k, (ids, offs, text_len) in tokens.items():
            msgs, text = rendered[k]
            truncated = len(ids) > self.max_length
            ids = ids[: self.max_length]
            if offs is not None:
                offs = offs[: self.max_length]
                limit = int(offs[-1, 1]) if truncated and len(offs) else len(text)
            else:
                limit = len(text) if not truncated else text_len
            try:
                spans = self._spans(msgs, text, limit, field)
            except ConversationError as exc:
                out[k] = exc
                continue
            except Exception as exc:  # the template refuses a prefix (e.g. it insists on alternating roles)
                out[k] = ConversationError(field, f"chat template failed on a prefix: {type(exc).__name__}: {exc}")
                continue
            mask = np.zeros(len(ids), dtype=np.int8)
            if offs is not None:
                starts, ends = offs[:, 0], offs[:, 1]
                for a, b in spans:  # overlap rule: tokens ending after a and starting before b
                    mask[np.searchsorted(ends, a, side="right"): np.searchsorted(starts, b, side="left")] = 1
            else:
                for a, b in spans:
                    na = len(self.tokenizer.encode(text[:a], add_special_tokens=False))
                    nb = len(self.tokenizer.encode(text[:b], add_special_tokens=False))
                    mask[min(na, len(ids)): min(nb, len(ids))] = 1
            out[k] = Encoded(ids, mask, truncated)
        return out  # type: ignore[return-value]


# Tokenizer classes that are fully described by tokenizer.json: loading them directly skips AutoTokenizer,
# which imports torch (seconds per process, times ten parallel preps).
_PLAIN_FAST = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_hf_tokenizer(model: str) -> Any:
    """The target tokenizer for a plan's ``target.model`` (a ``builtin:`` name, a folder or a hub id)."""
    from pipeline import model_assets

    path = Path(model_assets.resolve(model))
    cfg = read_json(path / "tokenizer_config.json") if path.is_dir() else None
    if cfg and cfg.get("tokenizer_class") in _PLAIN_FAST and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return model_assets.load_tokenizer(model)


def load_chat_tokenizer(model: str, max_length: int, template_kwargs: dict[str, Any] | None = None) -> ChatTokenizer:
    """The plan's target tokenizer (``target.model``, e.g. ``builtin:smollm2-135m-instruct``) as a ChatTokenizer."""
    return ChatTokenizer(load_hf_tokenizer(model), max_length, tokenizer_id=model, template_kwargs=template_kwargs)


# --------------------------------------------------------------------------------------------
# Shards
def features(kind: str) -> Any:
    """The ``datasets.Features`` of a shard kind: ``"tokenized"`` or ``"prompts"``."""
    from datasets import Features, List, Value

    if kind == "tokenized":
        return Features({"id": Value("string"), "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
                         "num_tokens": Value("int32")})
    if kind == "prompts":
        return Features({"id": Value("string"), "messages": List({"role": Value("string"), "content": Value("string")})})
    raise ValueError(f"unknown shard kind {kind!r}")


def _list_array(arrays: Sequence[np.ndarray], dtype: Any) -> Any:
    import pyarrow as pa

    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values))


def tokenized_table(ids: Sequence[str], encoded: Sequence[Encoded]) -> Any:
    """A pyarrow table with the tokenized shard schema."""
    import pyarrow as pa

    schema = features("tokenized").arrow_schema
    return pa.table({
        "id": pa.array(list(ids), type=pa.string()),
        "input_ids": _list_array([e.input_ids for e in encoded], np.int32),
        "loss_mask": _list_array([e.loss_mask for e in encoded], np.int8),
        "num_tokens": pa.array([e.num_tokens for e in encoded], type=pa.int32()),
    }, schema=schema)


def prompt_table(ids: Sequence[str], prompts: Sequence[list[dict[str, str]]]) -> Any:
    """A pyarrow table with the prompt shard schema."""
    import pyarrow as pa

    schema = features("prompts").arrow_schema
    return pa.table({"id": pa.array(list(ids), type=pa.string()), "messages": pa.array(list(prompts),
                     type=schema.field("messages").type)}, schema=schema)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_parquet_atomic(table: Any, path: Path) -> str:
    """Write ``table`` to ``path`` atomically; returns the file's sha256. Deterministic for equal tables."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=4096)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sha256_file(path)


class ShardStore:
    """Numbered shards + per-shard records + manifest in one output directory (see the module docstring)."""

    def __init__(self, out: Path, fingerprint: dict[str, Any]) -> None:
        self.out = Path(out)
        self.fingerprint = {"format_version": FORMAT_VERSION, **fingerprint}
        self.progress_dir = self.out / "progress"

    @property
    def manifest_path(self) -> Path:
        return self.out / "manifest.json"

    def shard_name(self, index: int) -> str:
        return f"{SHARD_PREFIX}{index:05d}.parquet"

    def record_path(self, index: int) -> Path:
        return self.progress_dir / f"{SHARD_PREFIX}{index:05d}.json"

    def clean_partials(self) -> list[Path]:
        """Remove temp files a killed writer left behind (only ``.*.partial`` in this store)."""
        gone = []
        for d in (self.out, self.progress_dir):
            if d.is_dir():
                for p in d.glob(".*.partial"):
                    p.unlink(missing_ok=True)
                    gone.append(p)
        return gone

    def _check_fingerprint(self, rec: dict[str, Any], what: str) -> None:
        fp = rec.get("fingerprint")
        if fp != self.fingerprint:
            diff = sorted(k for k in set(fp or {}) | set(self.fingerprint) if (fp or {}).get(k) != self.fingerprint.get(k))
            raise StaleOutputError(
                f"{what} was made with different settings ({', '.join(diff)} changed); "
                "retry the stage with --fresh to start over")

    def finished(self) -> list[dict[str, Any]]:
        """Records of the finished shards 0..k-1 whose files are intact; stops at the first gap."""
        out = []
        index = 0
        while True:
            rec = read_json(self.record_path(index))
            if rec is None:
                break
            self._check_fingerprint(rec, str(self.record_path(index)))
            path = self.out / rec["file"]
            if not path.is_file() or sha256_file(path) != rec["sha256"]:
                break
            out.append(rec)
            index += 1
        return out

    def commit(self, index: int, table: Any, state: dict[str, Any]) -> dict[str, Any]:
        """Write shard ``index`` and then its record (with the caller's resume ``state``)."""
        name = self.shard_name(index)
        sha = write_parquet_atomic(table, self.out / name)
        tokens = int(table.column("num_tokens").to_numpy().sum()) if "num_tokens" in table.column_names else None
        rec = {"index": index, "file": name, "rows": table.num_rows, "tokens": tokens, "sha256": sha,
               "fingerprint": self.fingerprint, **state}
        write_json(self.record_path(index), rec)
        return rec

    def manifest(self) -> dict[str, Any] | None:
        return read_json(self.manifest_path)

    def complete(self) -> dict[str, Any] | None:
        """The manifest when the output is finished with these settings and every shard is intact."""
        man = self.manifest()
        if man is None:
            return None
        self._check_fingerprint(man, str(self.manifest_path))
        for s in man["shards"]:
            p = self.out / s["file"]
            if not p.is_file() or sha256_file(p) != s["sha256"]:
                return None
        return man

    def write_manifest(self, kind: str, records: Iterable[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        shards = [{"file": r["file"], "rows": r["rows"], "sha256": r["sha256"],
                   **({"tokens": r["tokens"]} if r.get("tokens") is not None else {})} for r in records]
        man = {"kind": kind, **fields, "rows": sum(s["rows"] for s in shards), "shards": shards,
               "fingerprint": self.fingerprint}
        if kind == "tokenized":
            man["tokens"] = sum(s.get("tokens", 0) for s in shards)
        write_json(self.manifest_path, man)
        return man


def write_rejects(path: Path, rejects: Iterable[dict[str, Any]]) -> None:
    """``rejects.jsonl``: one ``{row, field, reason}`` object per line, written atomically."""
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rejects))
