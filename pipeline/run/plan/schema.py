"""Typed plan tables: the value checks every plan key goes through, and the one validator of a section.

A plan section (``[train]``, ``[serve]`` ...) is a frozen dataclass whose fields are declared with
:func:`setting`: its type (the annotation), its default and a one-line doc, with an optional range
or set of choices. :meth:`Section.parse` checks a TOML table against it once, when the plan loads:
an unknown key, a value of the wrong type or out of range is a :class:`PlanError` naming the file,
the section and the key. Cross-field rules live in a section's :meth:`Section.check`.

Dataclasses, not pydantic: the plan is read on the container by every stage and in the console, and
this module (like :mod:`pipeline.run.plan.dag`) needs only the standard library; the whole validator is
the ~150 lines below, and its errors use the plan's key syntax (``stage[3].after``).
This module is the bottom of the plan model: it imports nothing from the project.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Self

# Anything outside these bounds is a typo (or a fuzzer), and would overflow a float or a C long downstream.
MAX_INT = 2**53
_CONTROL = {chr(c) for c in range(32)} | {"\x7f"}


class PlanError(ValueError):
    """A plan problem, always naming the file and the key."""

    def __init__(self, file: Path | str, key: str, message: str) -> None:
        self.file, self.key = str(file), key
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")


# ------------------------------------------------------------------------------ value checks
def check_type(file: Path | str, key: str, value: Any, want: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and bool not in (want if isinstance(want, tuple) else (want,)):
        raise PlanError(file, key, f"expected {what}, got {value!r}")
    if not isinstance(value, want):
        raise PlanError(file, key, f"expected {what}, got {type(value).__name__} {value!r}")
    return value


def check_text(
    file: Path | str,
    key: str,
    value: Any,
    what: str = "a string",
    multiline: bool = False,
    empty: bool = True,
) -> str:
    """A string with no NUL (it cannot reach an argv or a path) and no control characters except,
    where ``multiline``, newline and tab (a shell command may span lines)."""
    check_type(file, key, value, str, what)
    bad = _CONTROL - ({"\n", "\t", "\r"} if multiline else set())
    hit = next((c for c in value if c in bad), None)
    if hit is not None:
        raise PlanError(file, key, f"contains the control character {hit!r}; not allowed here")
    if not empty and not value.strip():
        raise PlanError(file, key, f"expected {what}, got an empty string")
    return value


def check_int(file: Path | str, key: str, value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    check_type(file, key, value, int, what)
    if not lo <= value <= hi:
        raise PlanError(file, key, _out_of_range(value, lo, hi, MAX_INT))
    return int(value)


def _out_of_range(value: Any, lo: float, hi: float, top: float) -> str:
    """ "must be 0 or more, got -1" where only the floor matters; else both bounds."""
    if hi >= top and value < lo:
        return f"must be {_fmt(lo)} or more, got {value!r}"
    if (lo, hi) == (0, 1):
        return f"expected a fraction between 0 and 1, got {value!r}"
    return f"{value!r} is out of range: must be between {_fmt(lo)} and {_fmt(hi)}"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def check_num(file: Path | str, key: str, value: Any, what: str, lo: float = 0.0, hi: float = 1e9) -> float:
    check_type(file, key, value, (int, float), what)
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise PlanError(file, key, f"{value} is out of range ({lo:g}..{hi:g})")
    if not lo <= float(value) <= hi:  # also refuses nan and inf
        raise PlanError(file, key, _out_of_range(value, lo, hi, 1e18))
    return float(value)


def check_bool(file: Path | str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlanError(file, key, f"expected true or false, got {type(value).__name__} {value!r}")
    return value


def key_name(prefix: str, k: Any) -> str:
    """How an error names key ``k`` under ``prefix``: as TOML writes it, quoted when it is not a bare key."""
    name = (
        k
        if isinstance(k, str) and k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k)
        else json.dumps(str(k), ensure_ascii=False)
    )
    return f"{prefix}.{name}" if prefix else name


def str_list(file: Path | str, key: str, value: Any) -> list[str]:
    """A list of strings; one string is a list of one."""
    if isinstance(value, str):
        value = [value]
    check_type(file, key, value, list, "a list of strings")
    for i, v in enumerate(value):
        check_text(file, f"{key}[{i}]", v)
    return list(value)


# ------------------------------------------------------------------------------ sections
REQUIRED: Any = object()  # the default of a key the table must give (a dataset's name, a stage's id)


def setting(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[Any, ...] | None = None,
    positive: bool = False,
    multiline: bool = False,
    check: Callable[[Path | str, str, Any], Any] | None = None,
) -> Any:
    """A section field: its default, a one-line doc, and optionally a numeric range (``positive``: > 0)
    or the allowed values; a ``multiline`` string may hold newlines and tabs (a shell command); ``check``
    replaces the type check with its own (``check(file, key, value)`` returns the value or raises).
    A mutable default (a table or a list) is copied for each plan; :data:`REQUIRED` makes the key one
    the table must give.
    """
    meta: dict[str, Any] = {
        "doc": doc,
        "lo": lo,
        "hi": hi,
        "choices": choices,
        "positive": positive,
        "multiline": multiline,
    }
    meta["check"] = check
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    """How an error names a field's type: "an integer", "a list of strings" ..."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (tuple, list):
        inner = typing.get_args(tp)[0]
        return {int: "a list of integers", str: "a list of strings"}.get(inner, "a list")
    if origin is dict or tp is dict:
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(file: Path | str, key: str, value: Any, tp: Any, f: Field[Any]) -> Any:
    """``value`` as the field's type, or a PlanError naming ``key``."""
    lo, hi, choices = f.metadata.get("lo"), f.metadata.get("hi"), f.metadata.get("choices")
    if f.metadata.get("check") is not None:
        return f.metadata["check"](file, key, value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for a in options:  # the first member the value's TOML type matches decides
            if _matches(value, a):
                return _coerce(file, key, value, a, f)
        raise PlanError(file, key, f"expected {_describe(tp)}, got {type(value).__name__} {value!r}")
    if origin in (tuple, list):
        inner = typing.get_args(tp)[0]
        items = (
            str_list(file, key, value) if inner is str else check_type(file, key, value, list, _describe(tp))
        )
        out = [_coerce(file, f"{key}[{i}]", v, inner, f) for i, v in enumerate(items)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        return dict(check_type(file, key, value, dict, "a table"))
    if tp is bool:
        return check_bool(file, key, value)
    if tp in (int, float) and f.metadata.get("positive") and _matches(value, tp) and not value > 0:
        raise PlanError(file, key, f"must be > 0, got {value!r}")
    if tp is int:
        return check_int(
            file,
            key,
            value,
            "an integer",
            lo=int(lo) if lo is not None else -MAX_INT,
            hi=int(hi) if hi is not None else MAX_INT,
        )
    if tp is float:
        return check_num(
            file,
            key,
            value,
            "a number",
            lo=lo if lo is not None else -1e18,
            hi=hi if hi is not None else 1e18,
        )
    if tp is str:
        check_text(file, key, value, multiline=bool(f.metadata.get("multiline")))
        if choices is not None and value not in choices:
            raise PlanError(file, key, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported setting type {tp!r}")  # a schema bug, not a plan error


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, list) or (isinstance(value, str) and typing.get_args(tp)[0] is str)
    return isinstance(value, origin)


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """A section class's resolved field types, once per class: resolving them per stage was 25 of the 33 s
    ``aerie status`` took on a 10,000-stage plan."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


@dataclass(frozen=True)
class Section:
    """Base of every typed plan section (a frozen dataclass of :func:`setting` fields)."""

    NAME: ClassVar[str] = ""

    @classmethod
    def parse(cls, table: Any, file: Path | str, name: str | None = None) -> Self:
        """The section from its TOML table: every key known, typed and in range; then :meth:`check`."""
        name = name or cls.NAME
        check_type(file, name, table, dict, "a table")
        hints = _type_hints(cls)
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for k, v in table.items():
            if k not in known:
                raise PlanError(file, key_name(name, k), f"unknown key (known: {', '.join(sorted(known))})")
            values[k] = _coerce(file, f"{name}.{k}", v, hints[k], known[k])
        for f in known.values():
            if f.name not in values and f.default is MISSING and f.default_factory is MISSING:
                raise PlanError(file, f"{name}.{f.name}", f"required key missing ({f.metadata.get('doc')})")
        section = cls(**values)
        section.check(file, name)
        return section

    def check(self, file: Path | str, name: str) -> None:
        """Rules between fields (override); raise :class:`PlanError` through :meth:`bad`."""

    @staticmethod
    def bad(file: Path | str, key: str, message: str) -> NoReturn:
        raise PlanError(file, key, message)

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """Each field as ``(key, type, default, doc)``: what ``aerie plan check --show-defaults`` prints."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in fields(cls):
            default = (
                f.default
                if f.default is not MISSING
                else None
                if f.default_factory is MISSING
                else f.default_factory()
            )
            out.append((f.name, _describe(hints[f.name]), default, str(f.metadata.get("doc", ""))))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The resolved settings (defaults filled in), as TOML would write them."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out
