"""Aerie themes: the console look as data.

Each ``themes/*.toml`` file is one Textual theme: a ``[theme]`` table with Textual's ``Theme``
fields (name, dark, primary, ... background, surface, panel) and a ``[variables]`` table with extra
CSS variables, at least one ``state-<state>`` colour per run state (``state-running``,
``state-paused``, ``state-failed``, ``state-succeeded``...). Widgets never name a colour: they read
these variables (through ``AerieApp.state_style`` or CSS), so a new theme is a new TOML file.

:func:`load_themes` reads and checks them; an error names the file and the key.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from textual.color import Color, ColorParseError
from textual.theme import Theme

DEFAULT_THEME = "aerie-dark"
# The states every Aerie theme must colour (the board's vocabulary).
STATES = (
    "running",
    "starting",
    "ready",
    "pausing",
    "paused",
    "succeeded",
    "failed",
    "killed",
    "upstream-failed",
    "unhealthy",
    "pending",
    "skipped",
)
COLOR_FIELDS = (
    "primary",
    "secondary",
    "accent",
    "warning",
    "error",
    "success",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
NUMBER_FIELDS = ("luminosity_spread", "text_alpha")


class ThemeError(ValueError):
    """A theme file that is not valid, naming the file and the key."""


def _color(file: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ThemeError(f"{file}: {key}: expected a colour string, got {value!r}")
    try:
        Color.parse(value)
    except ColorParseError:
        raise ThemeError(f"{file}: {key}: {value!r} is not a colour") from None
    return value


def parse_theme(raw: dict[str, Any], file: str) -> Theme:
    """One theme from a TOML document (see the module docstring)."""
    for key in raw:
        if key not in ("theme", "variables"):
            raise ThemeError(f"{file}: {key}: unknown table (known: theme, variables)")
    t = raw.get("theme")
    if not isinstance(t, dict):
        raise ThemeError(f"{file}: theme: missing [theme] table")
    known = {"name", "dark", *COLOR_FIELDS, *NUMBER_FIELDS}
    for key in t:
        if key not in known:
            raise ThemeError(f"{file}: theme.{key}: unknown key (known: {', '.join(sorted(known))})")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ThemeError(f"{file}: theme.name: expected a name")
    if "primary" not in t:
        raise ThemeError(f"{file}: theme.primary: required")
    kw: dict[str, Any] = {k: _color(file, f"theme.{k}", t[k]) for k in COLOR_FIELDS if k in t}
    for k in NUMBER_FIELDS:
        if k in t:
            if not isinstance(t[k], int | float) or isinstance(t[k], bool):
                raise ThemeError(f"{file}: theme.{k}: expected a number, got {t[k]!r}")
            kw[k] = float(t[k])
    dark = t.get("dark", True)
    if not isinstance(dark, bool):
        raise ThemeError(f"{file}: theme.dark: expected true or false, got {dark!r}")
    variables = raw.get("variables", {})
    if not isinstance(variables, dict):
        raise ThemeError(f"{file}: variables: expected a table")
    for state in STATES:
        if f"state-{state}" not in variables:
            raise ThemeError(f"{file}: variables.state-{state}: every Aerie theme colours every state")
    variables = {k: _color(file, f"variables.{k}", v) for k, v in variables.items()}
    return Theme(name=name, dark=dark, variables=variables, **kw)


def theme_files() -> list[Path]:
    return sorted(Path(str(p)) for p in resources.files("themes").iterdir() if str(p).endswith(".toml"))


@cache
def load_themes() -> dict[str, Theme]:
    """Every bundled theme by name (the default first)."""
    out: dict[str, Theme] = {}
    for path in theme_files():
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ThemeError(f"{path}: not valid TOML: {exc}") from None
        theme = parse_theme(raw, str(path))
        if theme.name in out:
            raise ThemeError(f"{path}: theme.name: {theme.name!r} is also defined by another theme file")
        out[theme.name] = theme
    return dict(sorted(out.items(), key=lambda kv: kv[0] != DEFAULT_THEME))
