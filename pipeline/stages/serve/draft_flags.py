"""Which method a deployed draft was trained with, and that method's SGLang launch flags.

The draft's own ``aerie_provenance.json`` says (its recipe: the method's name and the ``[train]`` keys it was
trained with, e.g. DFlash's block size); an export without one is taken to be the plan's ``[train] draft``.
The flags come from the method's spec (:attr:`pipeline.drafts.registry.DraftMethod.serve_flags`), the one
source: a DFlash draft launches with ``--speculative-algorithm DFLASH`` and its block, an EAGLE-3 draft with
``EAGLE3`` and ``[deploy]``'s chain settings.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from pipeline.eagle3 import provenance
from pipeline.run.plan import draft_names
from pipeline.run.plan.dag import Plan
from pipeline.run.plan.sections import TrainSection


def _recipe(draft_dir: Path) -> dict[str, Any]:
    try:
        doc = provenance.read(draft_dir) if draft_dir.is_dir() else None
    except ValueError:
        return {}  # the provenance guard reports a malformed file
    recipe = doc.get("recipe") if isinstance(doc, dict) else None
    return recipe if isinstance(recipe, dict) else {}


def trained_with(plan: Plan, draft_dir: Path) -> tuple[str, TrainSection]:
    """The draft's method and the ``[train]`` settings it was trained with, as far as they shape serving."""
    recipe = _recipe(draft_dir)
    name = recipe.get("draft")
    train = plan.settings.train
    if not isinstance(name, str) or name not in draft_names.known():
        return train.draft, train
    values = recipe.get("train")
    values = values if isinstance(values, dict) else {}
    settings = draft_names.settings_class(name)
    own = {f.name for f in fields(settings)} if settings is not None else set()
    table = {k: v for k, v in values.items() if k in own and v is not None}
    return name, TrainSection.parse(
        {"draft": name, **table}, draft_dir / provenance.PROVENANCE_FILE, "recipe.train"
    )


def serve_flags(plan: Plan, draft_dir: Path) -> tuple[str, tuple[str, ...]]:
    """The draft's method name and its launch flags (all but the draft's path)."""
    from pipeline.drafts.registry import draft_method  # torch: only a speculative launch needs it

    name, train = trained_with(plan, draft_dir)
    return name, tuple(draft_method(name).serve_flags(train, plan.settings.deploy))
