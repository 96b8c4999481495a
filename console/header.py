"""The console's header lines as text: the header (run, connection, run dir, state counts), the projection
line under it (progress, finish, GPU-hours, disk at finish: :mod:`pipeline.run.projection.compute`) and the status
line at the bottom (the run's outcome, or the supervisor's liveness and alerts: :mod:`console.sup_watch`). Pure functions of the model: the app
sets them; :class:`ProjectionLine` spares it recomputing the projection on every poll."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.text import Text

from console.model import RunModel, StageView
from console.sup_watch import STALE_S, SupervisorWatch, alerts_line
from pipeline.run.plan import dag as plan_mod
from pipeline.run.projection.compute import DiskNow, StageProgress, project
from pipeline.run.projection.text import compact_line, span

PROJECTION_EVERY_S = 5.0  # the projection line is recomputed at least this often (sooner on a state change)
STALE_SUPERVISOR_S = STALE_S  # no new snapshot for this long: the console asks the host (restarts a dead one)


def header_text(model: RunModel, connection: str, width: int, style: Callable[[str], str]) -> Text:
    """``run · connection · run dir · counts``; the run dir gives way (its start becomes "…") so the counts fit."""
    counts = Text()
    for state, n in sorted(model.counts().items()):
        counts.append(f" {n} {state} ", style=style(state))
    t = Text()
    t.append(f" {model.run_name or 'Aerie'} ", style="bold")
    t.append(f" {connection} ")
    room = width - 2 - t.cell_len - counts.cell_len - 2
    path = str(model.run_dir)
    if len(path) > room:
        path = "…" + path[-max(0, room - 1) :] if room > 8 else ""
    if path:
        t.append(f" {path} ", style="dim")
    t.append_text(counts)
    return t


def status_text(
    model: RunModel,
    poll_s: float,
    style: Callable[[str], str],
    now: float | None = None,
    watch: SupervisorWatch | None = None,
) -> Text:
    """The link's error; else a silent or dead supervisor (``watch``: what the host said, and whether it is
    being restarted); else the supervisor's open alert (a write that fails, a damaged stage file); else the
    run's outcome, or the supervisor's pid."""
    now = time.time() if now is None else now
    line = Text()
    silent = watch.line(model.done) if watch is not None else None
    alert = alerts_line(model.supervisor_alerts)
    if model.error:
        line.append(model.error, style=style("failed"))
    elif silent is not None:
        line.append(silent[0], style=style("failed" if silent[1] == "error" else "paused"))
    elif not model.loaded:
        line.append(model.waiting_for, style=style("paused") if model.state_problem else "")
    elif alert is not None and not model.done:
        line.append(alert, style=style("paused"))
    elif model.done:
        ok = model.all_succeeded()
        line.append(
            "run finished: " + ("every stage succeeded" if ok else "some stages did not succeed"),
            style=style("succeeded" if ok else "failed"),
        )
    elif watch is None and model.supervisor_t and now - model.supervisor_t > STALE_SUPERVISOR_S:
        line.append(f"supervisor silent for {span(now - model.supervisor_t)}", style=style("paused"))
    else:
        line.append(f"supervisor pid {model.supervisor_pid} · polling every {poll_s:g}s")
    return line


def plan_of(raw: dict[str, Any], run_root: str) -> plan_mod.Plan | str:
    """The run's frozen plan (``RUN/plan.toml``, read through the transport), or why it cannot be used."""
    try:
        return plan_mod.from_dict(raw, Path(run_root) / "plan.toml", run_dir=run_root)
    except plan_mod.PlanError as exc:
        return str(exc)


def stage_progress(st: StageView) -> StageProgress:
    """What the projection needs of a stage: its row, its last progress and the rate over the recent window."""
    p = st.progress
    return StageProgress(
        state=str(st.state),
        started_at=st.started_at,
        finished_at=st.finished_at,
        done=p.done if p.t else None,
        total=p.total,
        unit=p.unit,
        t=p.t or None,
        rate=p.rate(),
        retry_at=st.retry_at,
    )


def projection_text(
    model: RunModel, plan: plan_mod.Plan | str | None, width: int, now: float | None = None
) -> Text:
    """One line under the header: progress, projected finish, GPU-hours used/projected, disk at finish."""
    if not model.loaded or plan is None:
        return Text("")
    if isinstance(plan, str):
        return Text(f"no projection: {plan}", style="dim")
    d = model.telemetry.disk
    disk = None
    used = d.used_bytes if d is not None else None
    if d is not None and used is not None and d.avail is not None and d.total is not None:  # the meter's disk
        disk = DiskNow(used, d.total, d.projected_remaining or 0, d.where, d.avail)
    progress = {sid: stage_progress(st) for sid, st in model.stages.items()}
    try:
        p = project(plan, progress, time.time() if now is None else now, disk)
    except (KeyError, ValueError) as exc:  # a state.json from another plan than the frozen one
        return Text(f"no projection: {type(exc).__name__}: {exc}", style="dim")
    return Text(compact_line(p, max(0, width - 2)))


class ProjectionLine:
    """:func:`projection_text`, recomputed when a stage changes state or attempt, the plan or the width
    changes or the first disk sample arrives, and otherwise at most every :data:`PROJECTION_EVERY_S`: its figures are whole minutes and tenths
    of GPU-hours, while a live run's progress changes every poll (recomputing it each poll and repainting the
    line for a changed second was a good share of the live console's CPU)."""

    def __init__(
        self, every_s: float = PROJECTION_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s, self.clock = every_s, clock
        self._key: tuple = ()
        self._at = -math.inf
        self._text = Text("")

    def text(self, model: RunModel, plan: plan_mod.Plan | str | None, width: int) -> Text:
        key = (
            id(plan),
            width,
            model.loaded,
            model.done,
            model.telemetry.disk
            is not None,  # the disk at finish appears with the first sample, not 5 s later
            tuple((sid, st.state, st.attempt, st.retry_at) for sid, st in model.stages.items()),
        )
        now = self.clock()
        if key != self._key or now - self._at >= self.every_s:
            self._key, self._at = key, now
            self._text = projection_text(model, plan, width)
        return self._text
