"""The source normalisers: one raw row of a public dataset, in its own schema, to a canonical conversation.

Each takes the row and the plan's ``options`` and returns the turns (see :mod:`pipeline.data.tokenise`), or
raises :class:`~pipeline.data.conversation.ConversationError` naming the source field that is wrong. The
registry that says which source uses which is :mod:`pipeline.data.sources`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.data.conversation import ConversationError

Row = dict[str, Any]
Normaliser = Callable[[Row, dict[str, Any]], list[dict[str, Any]]]


def type_name(v: Any) -> str:
    return "nothing (missing or null)" if v is None else type(v).__name__


def need_text(obj: Row, key: str, where: str = "", allow_empty: bool = False) -> str:
    path = f"{where}.{key}" if where else key
    v = obj.get(key)
    if not isinstance(v, str):
        raise ConversationError(path, f"expected text, got {type_name(v)}")
    if not allow_empty and not v.strip():
        raise ConversationError(path, "empty text")
    return v


def need_list(obj: Row, key: str) -> list[Any]:
    v = obj.get(key)
    if not isinstance(v, list):
        raise ConversationError(key, f"expected a list of turns, got {type_name(v)}")
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
            raise ConversationError(where, f"expected a turn object, got {type_name(t)}")
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
            raise ConversationError("system", f"expected text, got {type_name(system)}")
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
            raise ConversationError(where, f"expected a turn object, got {type_name(t)}")
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
        raise ConversationError(where, f"expected a tool call object, got {type_name(call)}")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ConversationError(f"{where}.function", f"expected an object, got {type_name(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}.function.name", f"expected a tool name, got {type_name(name)}")
    args = fn.get("arguments")
    if not isinstance(args, str | dict):
        raise ConversationError(
            f"{where}.function.arguments", f"expected a JSON string or object, got {type_name(args)}"
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
            raise ConversationError(where, f"expected a turn object, got {type_name(t)}")
        role = t.get("role")
        if role not in MESSAGE_ROLES:
            raise ConversationError(
                f"{where}.role", f"unknown role {role!r} (known: {', '.join(MESSAGE_ROLES)})"
            )
        raw_calls = t.get("tool_calls")
        if raw_calls is not None and not isinstance(raw_calls, list):
            raise ConversationError(f"{where}.tool_calls", f"expected a list, got {type_name(raw_calls)}")
        calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls or [])]
        if role == "assistant" and calls:
            content = t.get("content")
            if content is None:
                content = ""
            elif not isinstance(content, str):
                raise ConversationError(f"{where}.content", f"expected text, got {type_name(content)}")
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
            raise ConversationError(tf, f"expected text, got {type_name(thinking)}")
        if thinking.strip():
            turn["reasoning"] = thinking
    return [{"role": "user", "content": need_text(row, pf), "_src": {"content": pf}}, turn]
