"""Tokenising canonical conversations with the target's chat template, with loss masks.

Shared tokenising and shard I/O: canonical conversations -> target-tokenised, loss-masked Parquet shards.

Both the prep stage (target-native sources) and the regeneration stage (conversations whose replies the
target model rewrote) go through this module, so "what a training row is" is defined exactly once.
Nothing here reads a plan or emits events; callers do that.

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
    arguments as the source had them (JSON text or object) and ``reasoning_content``. A template that drops
    the reasoning of every assistant turn it is given (Kimi-K2.5) has its final turn trained as the model
    generated it — reasoning, answer, end of turn after the generation prompt — with the reasoning in the
    loss mask, and the earlier turns as it renders them at serving time (``<think></think>answer``). A text holding
    one of the tokenizer's special tokens (``<|im_end|>``) is refused: it would silently end the turn.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.conversation import ConversationError, fold_tool_calls, source_field
from pipeline.run.rundir.layout import read_json

# A cut is safe after "\n" with non-space on both sides: every pre-tokenizer in use (ByteLevel regex,
# Metaspace, Split on whitespace) ends a piece there, so the tokens before it cannot change.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_CHARS_PER_TOKEN_GUESS = (
    4  # most text has 3-4.5; denser text (CJK, digits) costs one retry at twice the length
)
_CUT_MARGIN_TOKENS = 16


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

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        tokenizer_id: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        method: str = "auto",
    ) -> None:
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
        backend = (
            getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        )
        if method not in ("auto", "offsets", "prefix"):
            raise ValueError(f"method must be auto, offsets or prefix, got {method!r}")
        if method == "offsets" and backend is None:
            raise ValueError("method 'offsets' needs a fast tokenizer")
        self._backend = backend if method in ("auto", "offsets") else None
        self.method = "offsets" if self._backend is not None else "prefix"
        specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
        )
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._compiled = self._compile()
        self.generation_tail = self._generation_tail()

    # -- rendering --------------------------------------------------------------------------
    def _compile(self) -> Any:
        """The compiled template, when rendering it directly matches ``apply_chat_template`` (it is faster)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            return None
        probe = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        kw = {**self.tokenizer.special_tokens_map, **self.template_kwargs}
        try:
            compiled = _compile_jinja_template(self.template)
            for msgs, gen in ((probe, False), (probe[:2], True)):
                mine = compiled.render(
                    messages=msgs, tools=None, documents=None, add_generation_prompt=gen, **kw
                )
                ref = self.tokenizer.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=gen, **self.template_kwargs
                )
                if mine != ref:
                    return None
        except Exception:  # an unusual template: always go through apply_chat_template
            return None
        return compiled

    def _generation_tail(self) -> tuple[str, str] | None:
        """``(between, after)`` when the template drops a finished final turn's reasoning (Kimi-K2.5 renders
        every assistant turn it is given as ``<think></think>answer``) while its generation prompt opens the
        reasoning the model then writes: the final turn is then trained as it was generated, prompt +
        ``reasoning + between + answer + after``. None when the template keeps the reasoning, has none, or the
        plan switched thinking off (``thinking = false``: the model writes no reasoning)."""
        if not self.native_reasoning or self.template_kwargs.get("thinking") is False:
            return None
        user = {"role": "user", "content": "u"}
        answer = {"role": "assistant", "content": "ANSWER7", "reasoning_content": "REASON7"}
        try:
            head = self.render([user], add_generation_prompt=True)
            whole = self.render([user, answer])
        except Exception:
            return None
        if "REASON7" in whole or not whole.startswith(head) or whole[len(head) :].count("ANSWER7") != 1:
            return None
        between, after = whole[len(head) :].split("ANSWER7")
        return between, after

    def render_for_training(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        """The text a conversation is trained on, and whether its final turn is the model's own generation
        (see :meth:`_generation_tail`): everything before it as the template renders it at serving time, then
        the final turn's reasoning and answer exactly as the model wrote them after the generation prompt."""
        last = messages[-1] if messages else {}
        if (
            self.generation_tail is None
            or last.get("role") != "assistant"
            or not last.get("reasoning_content")
            or last.get("tool_calls")
        ):
            return self.render(messages), False
        between, after = self.generation_tail
        head = self.render(messages[:-1], add_generation_prompt=True)
        return head + last["reasoning_content"] + between + (last.get("content") or "") + after, True

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for already-converted template messages (see :meth:`template_messages`)."""
        if self._compiled is not None:
            return self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokenizer.special_tokens_map,
                **self.template_kwargs,
            )
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def template_messages(self, conv: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonical turns -> what the chat template expects (native or folded tool calls / reasoning)."""
        out: list[dict[str, Any]] = []
        for t in conv:
            m: dict[str, Any] = {"role": t["role"], "content": t["content"]}
            if t["role"] == "assistant":
                if t.get("tool_calls"):
                    if self.native_tool_calls:
                        m["tool_calls"] = [
                            {
                                "id": c.get("id") or f"call_{i}",
                                "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]},
                            }
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
                texts.append(
                    (f"tool_calls[{j}]", call["name"] + (args if isinstance(args, str) else json.dumps(args)))
                )
            for key, text in texts:
                if isinstance(text, str) and (m := self._specials.search(text)):
                    raise ConversationError(
                        source_field(t, key, f"{field}[{i}].{key}"),
                        f"contains the special token {m.group(0)!r}",
                    )

    def _spans(
        self, msgs: list[dict[str, Any]], rendered: str, limit: int, field: str, generated: bool = False
    ) -> list[tuple[int, int]]:
        """Character spans of the assistant turns that start before ``limit``; with ``generated`` the final
        turn is the model's own generation (reasoning included) and runs to the end of the text."""
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head = self.render(msgs[:i], add_generation_prompt=True)
            if not rendered.startswith(head):
                raise ConversationError(
                    f"{field}[{i}]",
                    "the chat template renders this turn's history differently "
                    "from the whole conversation; cannot locate the assistant text",
                )
            if len(head) >= limit:
                break
            if generated and i == len(msgs) - 1:
                spans.append((len(head), len(rendered.rstrip())))
                break
            full = self.render(msgs[: i + 1])
            if not rendered.startswith(full):
                raise ConversationError(
                    f"{field}[{i}]",
                    "the chat template renders this turn differently inside "
                    "the whole conversation; cannot locate the assistant text",
                )
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
            out: list[tuple[int, np.ndarray, np.ndarray | None]] = []
            for e in self._backend.encode_batch(texts, add_special_tokens=False):
                n = len(e)
                if n > keep:
                    e.truncate(keep)
                out.append(
                    (
                        n,
                        np.asarray(e.ids, dtype=np.int32),
                        np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2),
                    )
                )
            return out
        res: list[tuple[int, np.ndarray, np.ndarray | None]] = []
        for t in texts:
            ids = self.tokenizer.encode(t, add_special_tokens=False)
            res.append((len(ids), np.asarray(ids[:keep], dtype=np.int32), None))
        return res

    def encode(
        self, convs: Sequence[Sequence[dict[str, Any]]], field: str = "messages"
    ) -> list[Encoded | ConversationError]:
        """Tokenise conversations (canonical, checked, ending with an assistant turn) with loss masks."""
        out: list[Encoded | ConversationError | None] = [None] * len(convs)
        rendered: dict[int, tuple[list[dict[str, Any]], str]] = {}
        generated: set[int] = set()
        for k, conv in enumerate(convs):
            try:
                self._check_specials(conv, field)
                msgs = self.template_messages(conv)
                text, gen = self.render_for_training(msgs)
                rendered[k] = (msgs, text)
                if gen:
                    generated.add(k)
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
                spans = self._spans(msgs, text, limit, field, generated=k in generated)
            except ConversationError as exc:
                out[k] = exc
                continue
            except Exception as exc:  # the template refuses a prefix (e.g. it insists on alternating roles)
                out[k] = ConversationError(
                    field, f"chat template failed on a prefix: {type(exc).__name__}: {exc}"
                )
                continue
            mask = np.zeros(len(ids), dtype=np.int8)
            if offs is not None:
                starts, ends = offs[:, 0], offs[:, 1]
                for a, b in spans:  # overlap rule: tokens ending after a and starting before b
                    mask[np.searchsorted(ends, a, side="right") : np.searchsorted(starts, b, side="left")] = 1
            else:
                for a, b in spans:
                    na = len(self.tokenizer.encode(text[:a], add_special_tokens=False))
                    nb = len(self.tokenizer.encode(text[:b], add_special_tokens=False))
                    mask[min(na, len(ids)) : min(nb, len(ids))] = 1
            out[k] = Encoded(ids, mask, truncated)
        return out  # type: ignore[return-value]


# Tokenizer classes that are fully described by tokenizer.json: loading them directly skips AutoTokenizer,
# which imports torch (seconds per process, times ten parallel preps).
_PLAIN_FAST = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_hf_tokenizer(model: str, *, trust_remote_code: bool = False) -> Any:
    """The target tokenizer for a plan's ``target.model`` (a ``builtin:`` name, a folder or a hub id);
    ``trust_remote_code`` is the plan's ``target.trust_remote_code``
    (:func:`pipeline.data.model_assets.load_tokenizer`)."""
    from pipeline.data import model_assets

    path = Path(model_assets.resolve(model))
    cfg = read_json(path / "tokenizer_config.json") if path.is_dir() else None
    if cfg and cfg.get("tokenizer_class") in _PLAIN_FAST and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return model_assets.load_tokenizer(model, trust_remote_code=trust_remote_code)


def load_chat_tokenizer(
    model: str,
    max_length: int,
    template_kwargs: dict[str, Any] | None = None,
    *,
    trust_remote_code: bool = False,
) -> ChatTokenizer:
    """The plan's target tokenizer (``target.model``, e.g. ``builtin:smollm2-135m-instruct``) as a ChatTokenizer."""
    return ChatTokenizer(
        load_hf_tokenizer(model, trust_remote_code=trust_remote_code),
        max_length,
        tokenizer_id=model,
        template_kwargs=template_kwargs,
    )
