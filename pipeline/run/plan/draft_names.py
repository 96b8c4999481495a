"""The draft methods a plan may name in ``[train] draft``: the built-in ones and those registered from
outside the package through ``AERIE_DRAFT_METHODS``, each a name and where its package is.

Only names and locations (no torch): the plan checks ``[train] draft`` against them when it loads, and
:mod:`pipeline.drafts.registry` imports the package a name points at when a stage needs the method.
``AERIE_DRAFT_METHODS`` is a comma-separated list of ``name=location`` entries; a location is a module path
(``my_drafts.toy``) or a folder holding an ``__init__.py`` (or a ``.py`` file) anywhere on disk.
"""

from __future__ import annotations

import os

ENV = "AERIE_DRAFT_METHODS"

# name -> the module that defines it (its attribute METHOD is the pipeline.drafts.registry.DraftMethod)
BUILT_IN: dict[str, str] = {
    "eagle3": "pipeline.drafts.eagle3.method",
    "dflash": "pipeline.drafts.dflash.method",
}


class DraftNameError(ValueError):
    """``AERIE_DRAFT_METHODS`` is malformed: the entry and what a well-formed one looks like."""


def external(value: str | None = None) -> dict[str, str]:
    """The methods ``AERIE_DRAFT_METHODS`` (or ``value``) registers: name -> module path or folder."""
    raw = os.environ.get(ENV, "") if value is None else value
    found: dict[str, str] = {}
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, eq, where = (x.strip() for x in entry.partition("="))
        if not eq or not name or not where or not name.isidentifier():
            raise DraftNameError(
                f"{ENV}: {entry!r} is not name=location (e.g. toy=/path/to/toy_method or toy=my_pkg.toy)"
            )
        if name in BUILT_IN:
            raise DraftNameError(f"{ENV}: {name!r} is a built-in draft method; give yours another name")
        found[name] = where
    return found


def known() -> dict[str, str]:
    """Every draft method a plan may name: the built-in ones first, then the registered ones."""
    return {**BUILT_IN, **external()}
