"""Canonical conversations: the one shape every source is normalised to before tokenising.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A conversation (or source row) that cannot be used, naming the field and why."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


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
            raise ConversationError(
                source_field(turn, "content", f"{key}.content"),
                f"expected text, got {type(content).__name__}",
            )
        calls = turn.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ConversationError(
                    f"{key}.tool_calls", f"only assistant turns carry tool calls, not {role}"
                )
            if not isinstance(calls, list):
                raise ConversationError(f"{key}.tool_calls", "expected a list")
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
                    raise ConversationError(f"{key}.tool_calls[{j}].name", "a tool call needs a name")
                if not isinstance(call.get("arguments"), str | dict):
                    raise ConversationError(
                        f"{key}.tool_calls[{j}].arguments", "expected a JSON string or object"
                    )
        reasoning = turn.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ConversationError(
                source_field(turn, "reasoning", f"{key}.reasoning"),
                f"expected text, got {type(reasoning).__name__}",
            )
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
        parts.append(
            "<tool_call>\n"
            + json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False)
            + "\n</tool_call>"
        )
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
