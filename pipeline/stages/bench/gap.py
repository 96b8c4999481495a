"""The train-versus-serve gap: the accept length this bench measured (offline here, or served by SGLang) beside
the one the train stage simulated on held-out rows for the same draft (its manifest's ``accept_length``, at the
step it kept), with the rows and files each came from.

Written into the bench's ``results.json``/``manifest.json`` (``accept_gap``) and as one ``message`` event coded
``accept-gap`` carrying the same fields, which the supervisor's ``accept-gap`` rule reads
(:func:`pipeline.run.alerts.stage_rules.accept_gap`: an alert beyond ``[alerts] accept_gap``). Nothing when the
train manifest has no simulated accept length (a draft trained elsewhere) or the bench measured none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.manifests import train as train_manifest
from pipeline.manifests.base import of_kind
from pipeline.manifests.train import DraftManifest
from pipeline.run.stage_side.runtime import StageContext

CODE = "accept-gap"  # the message code the alert rule reads


def gap_record(
    man: DraftManifest, train_dir: Path, served: float | None, served_from: str, how: str = "served"
) -> dict[str, Any] | None:
    """Both numbers and where they came from (``how``: ``served`` by SGLang, or ``measured`` offline); None
    when either is missing."""
    sim = man.accept_length
    if served is None or sim is None or sim <= 0:
        return None
    step = f" at step {man.step}" if man.step is not None else ""
    return {
        "simulated": sim,
        "simulated_step": man.step,
        "simulated_from": f"{Path(train_dir) / 'manifest.json'}: accept_length{step} (held-out rows)",
        "served": served,
        "served_from": served_from,
        "gap": (sim - served) / sim,
        "how": how,
    }


def train_draft(ctx: StageContext, inputs: list[Path]) -> tuple[DraftManifest, Path] | None:
    """The train stage's draft manifest for an online bench: among the inputs, else the run's train stage (the
    served draft is the one it trained: ``[deploy]``); None when there is none (a draft trained elsewhere)."""
    dirs = list(inputs)
    if ctx.run_dir is not None:
        dirs += [Path(ctx.run_dir) / "stages" / s.id / "out" for s in ctx.plan.stages if s.run == "train"]
    for d in dirs:
        for mpath in of_kind(d, (train_manifest.KIND,)):
            try:
                return train_manifest.read(mpath), mpath.parent
            except ValueError:
                continue
    return None


def report_gap(ctx: StageContext, gap: dict[str, Any] | None) -> None:
    """The event the alert rule reads (and the operator sees in the stage's messages)."""
    if gap is None:
        return
    pct = gap["gap"] * 100
    ctx.message(
        f"accept length {gap['served']:.3f} here vs {gap['simulated']:.3f} simulated in training for the same "
        f"draft ({abs(pct):.1f}% {'lower' if pct >= 0 else 'higher'})",
        code=CODE,
        **gap,
    )
