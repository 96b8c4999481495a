"""Console settings: the theme and the alerts, from the command line, the user's config and the plan.

Where each comes from, strongest first:

* theme: ``--theme``, then the user's config ``[ui] theme``, then the plan's ``[ui] theme``, then
  ``aerie-dark``. (A personal choice, e.g. the colour-blind-safe theme, beats the team's plan.)
* alerts: ``[alerts] bell`` / ``notify`` from the user's config, else the plan's, else on. No hook runs in
  the console: the plan's ``[alerts] command`` runs on the executing host where the alert is raised, the user's
  config's one under ``aerie watch`` (:attr:`Settings.hooks` lists both, plan's first; ``timeout_s``, default 30).
* alert rules (``stall_minutes``, ``diverge_factor`` ... :data:`RULE_KEYS`) are evaluated on the executing host
  with the plan's values (:attr:`Settings.rules` shows them); the same keys in the user's config change nothing
  there, so each is a problem line saying to set it in the plan.

The user's config is ``$AERIE_CONFIG``, else ``$XDG_CONFIG_HOME/aerie/config.toml``, else
``~/.config/aerie/config.toml``; it may hold ``[ui]`` and ``[alerts]``. A bad key or value never
stops the console: it becomes a problem line (naming the file and the key) shown once.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pipeline.run.plan.schema import PlanError
from pipeline.run.plan.sections import AlertsSection, UiSection
from themes import DEFAULT_THEME

# The keys and defaults are the plan's (pipeline/run/plan/sections.py); the user's config uses the same tables.
UI_KEYS = tuple(f.name for f in fields(UiSection))
ALERT_KEYS = tuple(f.name for f in fields(AlertsSection))
RULE_KEYS = tuple(k for k in ALERT_KEYS if k not in ("command", "bell", "notify", "timeout_s"))


def user_config_path() -> Path:
    if os.environ.get("AERIE_CONFIG"):
        return Path(os.environ["AERIE_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aerie" / "config.toml"


def state_dir() -> Path:
    """Where the console keeps its own small state (aerie serve's tokens): the user's state directory."""
    if os.environ.get("AERIE_STATE_DIR"):
        return Path(os.environ["AERIE_STATE_DIR"]).expanduser()
    if os.environ.get("AERIE_HOME"):
        return Path(os.environ["AERIE_HOME"]).expanduser() / "state"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "aerie"


@dataclass
class Settings:
    theme: str = DEFAULT_THEME
    theme_from: str = "default"
    bell: bool = AlertsSection.bell
    notify: bool = AlertsSection.notify
    hooks: list[str] = field(default_factory=list)
    hook_timeout_s: float = AlertsSection.timeout_s
    rules: AlertsSection = field(default_factory=AlertsSection)  # the anomaly thresholds
    problems: list[str] = field(default_factory=list)


def read_user_config(path: Path | None = None) -> tuple[dict[str, Any], list[str]]:
    """The user's config as a dict (empty if there is none) and any problem reading it."""
    path = path or user_config_path()
    try:
        return tomllib.loads(path.read_text()), []
    except FileNotFoundError:
        return {}, []
    except (OSError, UnicodeDecodeError) as exc:
        return {}, [f"{path}: cannot read: {exc}"]
    except tomllib.TOMLDecodeError as exc:
        return {}, [f"{path}: not valid TOML: {exc}"]


def _section(
    raw: dict[str, Any], name: str, keys: tuple[str, ...], where: str, problems: list[str]
) -> dict[str, Any]:
    sec = raw.get(name, {})
    if not isinstance(sec, dict):
        problems.append(f"{where}: {name}: expected a table, got {sec!r}")
        return {}
    out = {}
    for k, v in sec.items():
        if k not in keys:
            problems.append(f"{where}: {name}.{k}: unknown key (known: {', '.join(keys)})")
        else:
            out[k] = v
    return out


def _typed(
    sec: dict[str, Any],
    key: str,
    types: tuple[type, ...],
    what: str,
    where: str,
    section: str,
    problems: list[str],
) -> Any:
    if key not in sec:
        return None
    v = sec[key]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        problems.append(f"{where}: {section}.{key}: expected {what}, got {v!r}")
        return None
    return v


def resolve(
    cli_theme: str | None,
    user: dict[str, Any],
    user_where: str,
    plan: dict[str, Any],
    plan_where: str,
    known_themes: list[str],
) -> Settings:
    """Merge the three sources (see the module docstring); unknown themes fall back with a problem."""
    s = Settings()
    p = s.problems
    layers = [(plan, plan_where), (user, user_where)]  # weakest first
    for raw, where in layers:
        ui = _section(raw, "ui", UI_KEYS, where, p)
        theme = _typed(ui, "theme", (str,), "a theme name", where, "ui", p)
        if theme is not None:
            if theme in known_themes:
                s.theme, s.theme_from = theme, where
            else:
                p.append(f"{where}: ui.theme: unknown theme {theme!r} (known: {', '.join(known_themes)})")
        al = _section(raw, "alerts", ALERT_KEYS, where, p)
        for key in ("bell", "notify"):
            v = _typed(al, key, (bool,), "true or false", where, "alerts", p)
            if v is not None:
                setattr(s, key, v)
        cmd = _typed(al, "command", (str,), "a shell command", where, "alerts", p)
        if cmd and cmd.strip():
            s.hooks.append(cmd)
        t = _typed(al, "timeout_s", (int, float), "seconds", where, "alerts", p)
        if t is not None:
            if t > 0:
                s.hook_timeout_s = float(t)
            else:
                p.append(f"{where}: alerts.timeout_s: must be > 0, got {t!r}")
        if raw is user:
            p += [
                f"{where}: alerts.{k}: the rules run on the executing host: set it in the plan"
                for k in al
                if k in RULE_KEYS
            ]
        else:
            s.rules = _rules(s.rules, al, where, p)
    if cli_theme:
        s.theme, s.theme_from = cli_theme, "--theme"
    return s


def _rules(rules: AlertsSection, al: dict[str, Any], where: str, problems: list[str]) -> AlertsSection:
    """``rules`` with this layer's anomaly keys, each checked as the plan's loader checks it."""
    good: dict[str, Any] = {}
    for k in RULE_KEYS:
        if k in al:
            try:
                good[k] = getattr(AlertsSection.parse({k: al[k]}, where), k)  # typed: 30 -> 30.0
            except PlanError as exc:
                problems.append(str(exc))
    return replace(rules, **good)
