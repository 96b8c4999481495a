"""The projection of one run directory on its executing host (``ctl status``, hence ``aerie status``): the
frozen plan, ``state.json``'s rows and the disk (free space, and what the stages still have to write, from
:mod:`pipeline.run.supervise.budget`) fed to the pure :func:`pipeline.run.projection.compute.project`."""

from __future__ import annotations

from typing import Any

from pipeline.run.plan import dag as plan_mod
from pipeline.run.projection.compute import DiskNow, StageProgress, project
from pipeline.run.rundir.layout import RunDir
from pipeline.run.supervise import budget


def run_projection(run: RunDir, state: dict[str, Any], now: float) -> dict[str, Any]:
    """The projection as a JSON object; ``{"error": …}`` naming the file when it cannot be made."""
    try:
        plan = plan_mod.load(run.plan_path, run_dir=run.root)
    except plan_mod.PlanError as exc:
        return {"error": str(exc)}
    rows = [r for r in state.get("stages", []) if isinstance(r, dict) and "id" in r]
    progress = {r["id"]: StageProgress.from_row(r) for r in rows}
    disk = None
    try:
        total, used, avail = budget.disk_free(run.root)
        states = {sid: p.state for sid, p in progress.items()}
        to_write = budget.remaining_projected_output(plan, run, states)
        disk = DiskNow(
            used, total, to_write, budget.mount_of(run.root), avail
        )  # df's terms, as the disk meter
    except OSError:
        disk = None  # no reading of the filesystem: the projection says nothing of the disk
    return project(plan, progress, now, disk).to_dict()
