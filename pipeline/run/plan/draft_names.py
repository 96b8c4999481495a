"""The draft methods a plan may name in ``[train] draft``: the built-in ones and those registered from
outside the package through ``AERIE_DRAFT_METHODS``, each a name, where its package is and where its own
``[train]`` keys are declared.

Only names and locations (no torch): the plan checks ``[train] draft`` against them when it loads, and
:mod:`pipeline.drafts.registry` imports the package a name points at when a stage needs the method.
``AERIE_DRAFT_METHODS`` is a comma-separated list of ``name=location[@settings]`` entries; a location is a
module path (``my_drafts.toy``) or a folder holding an ``__init__.py`` (or a ``.py`` file) anywhere on disk.

A method's own plan keys live in its *settings* module (standard library only: the plan loads it without
torch), which defines ``SETTINGS``, a :class:`~pipeline.run.plan.sections.DraftSettings` subclass. It is the
``@settings`` part of an entry (a module path or a ``.py`` file), else a registered folder's ``settings.py``
where there is one; a method without one has no keys of its own. :func:`settings_class` imports it by that
location (never the method's package, whose ``__init__`` may import torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "AERIE_DRAFT_METHODS"
SETTINGS_FILE = "settings.py"  # a registered folder's own [train] keys, when it has them


@dataclass(frozen=True)
class Registration:
    """Where a draft method lives: its spec's module (its attribute ``METHOD`` is the
    :class:`pipeline.drafts.registry.DraftMethod`), and the standard-library module whose ``SETTINGS`` declares
    its own ``[train]`` keys (``None``: it has none)."""

    method: str
    settings: str | None = None


BUILT_IN: dict[str, Registration] = {
    "eagle3": Registration("pipeline.drafts.eagle3.method"),
    "dflash": Registration("pipeline.drafts.dflash.method", settings="pipeline.drafts.dflash.settings"),
}


class DraftNameError(ValueError):
    """``AERIE_DRAFT_METHODS`` is malformed, or a method's settings module cannot be loaded: what is wrong."""


def _is_path(where: str) -> bool:
    return where.endswith(".py") or where.startswith((".", "/", "~"))


def _folder_settings(where: str) -> str | None:
    """A registered folder's ``settings.py``, if it has one."""
    if not _is_path(where) or where.endswith(".py"):
        return None
    file = Path(where).expanduser() / SETTINGS_FILE
    return str(file) if file.is_file() else None


def external(value: str | None = None) -> dict[str, Registration]:
    """The methods ``AERIE_DRAFT_METHODS`` (or ``value``) registers: name -> where it and its settings are."""
    raw = os.environ.get(ENV, "") if value is None else value
    found: dict[str, Registration] = {}
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, eq, rest = (x.strip() for x in entry.partition("="))
        where, at, settings = (x.strip() for x in rest.partition("@"))
        if not eq or not name or not where or not name.isidentifier() or (at and not settings):
            raise DraftNameError(
                f"{ENV}: {entry!r} is not name=location[@settings] (e.g. toy=/path/to/toy_method or "
                "toy=my_pkg.toy@my_pkg.toy_settings)"
            )
        if name in BUILT_IN:
            raise DraftNameError(f"{ENV}: {name!r} is a built-in draft method; give yours another name")
        found[name] = Registration(where, settings or _folder_settings(where))
    return found


def known() -> dict[str, Registration]:
    """Every draft method a plan may name: the built-in ones first, then the registered ones."""
    return {**BUILT_IN, **external()}


_settings: dict[tuple[str, str], Any] = {}


def settings_class(name: str) -> Any:
    """The ``SETTINGS`` class of method ``name`` (``None``: it declares no keys of its own), its module
    imported once. The caller checks what it is (:mod:`pipeline.run.plan.sections` knows the base class)."""
    reg = known().get(name)
    if reg is None:
        raise DraftNameError(f"no draft method named {name!r} (known: {', '.join(known())})")
    if reg.settings is None:
        return None
    key = (name, reg.settings)
    if key not in _settings:
        module = _load(name, reg.settings)
        if not hasattr(module, "SETTINGS"):
            raise DraftNameError(f"{reg.settings}: the {name} draft's settings module defines no SETTINGS")
        _settings[key] = module.SETTINGS
    return _settings[key]


def _load(name: str, where: str) -> Any:
    """A module path, or a ``.py`` file loaded on its own (not as part of its folder's package)."""
    try:
        if not _is_path(where):
            return importlib.import_module(where)
        file = Path(where).expanduser()
        if not file.is_file():
            raise DraftNameError(f"{ENV}: {name}: {where}: no such settings file")
        mod_name = f"aerie_draft_settings_{name}"
        spec = importlib.util.spec_from_file_location(mod_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses resolve the module's annotations through it
        spec.loader.exec_module(module)
        return module
    except DraftNameError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan error names the module and what stopped it
        raise DraftNameError(
            f"{where}: the {name} draft's settings module does not load: {type(exc).__name__}: {exc}"
        ) from exc
