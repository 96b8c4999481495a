"""A stage's status row — the one definition of what ``state.json`` says of a stage — and its states:
where it is (:class:`StageState`), how an attempt ended (:class:`ExitStatus`), a service's health
(:class:`HealthState`) and what the console shows (:class:`DisplayState`). Each a ``StrEnum`` whose
values are the strings the run's files hold, so a run dir written before them reads the same.

The supervisor derives one :class:`StageRow` per stage and writes them all to ``state.json``; the
console reads them back into its views (which add what only the console keeps: progress rates, log
tails, metric history). Both sides extend this class, so a field added here reaches the file, the
console and ``aerie status`` at once. Standard library only: the console imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any


class StageState(StrEnum):
    """Where a stage is. A ``StrEnum``: each member *is* its string, as ``state.json`` stores it."""

    PENDING = "pending"  # waiting for its dependencies, its services, or the resources it needs
    READY = "ready"  # a service that answers its health checks (dependants may start)
    RUNNING = "running"  # an attempt is running (under Slurm: also submitted and queued)
    PAUSED = "paused"  # stopped with SIGSTOP (or suspended by Slurm) at the operator's word
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the attempt exited non-zero (a retry may be scheduled: ``retry_at``)
    KILLED = "killed"  # stopped at the operator's word, or by a guard (disk, GPU)
    UPSTREAM_FAILED = "upstream-failed"  # a stage it runs after is broken
    SKIPPED = "skipped"  # the plan or the operator said not to run it; counts as satisfied


class ExitStatus(StrEnum):
    """How an attempt ended: the ``status`` of its ``finished`` event (the launcher's word, from its return
    code and the supervisor's kill marker) and the coarse state ``aerie status`` reads from ``exit.json``."""

    SUCCEEDED = "succeeded"  # exit 0, or a service stopped because its users were done
    FAILED = "failed"  # non-zero exit, or it could not start
    KILLED = "killed"  # stopped at the operator's word or by a guard


class HealthState(StrEnum):
    """A service's health, as its ``health`` events say and ``state.json``'s ``health`` field keeps it."""

    STARTING = "starting"  # launched, not answering its probe yet
    READY = "ready"  # answers its probe: dependants may start
    UNHEALTHY = "unhealthy"  # stopped answering (or never did within its startup time)
    STOPPED = "stopped"  # shut down


class DisplayState(StrEnum):
    """What the console and ``aerie status`` show a stage as: its :class:`StageState`, or for a running one
    the finer word (pausing, starting, a service's health). The console's one table of how each looks is
    ``console.states.DISPLAY``."""

    PENDING = "pending"
    STARTING = "starting"  # running, but its process (or Slurm job) has not started its work yet
    RUNNING = "running"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    PAUSING = "pausing"  # paused at the operator's word, the stage not stopped yet
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    UPSTREAM_FAILED = "upstream-failed"
    SKIPPED = "skipped"


TERMINAL = frozenset(
    {
        StageState.SUCCEEDED,
        StageState.FAILED,
        StageState.KILLED,
        StageState.UPSTREAM_FAILED,
        StageState.SKIPPED,
    }
)
SATISFIED = frozenset({StageState.SUCCEEDED, StageState.SKIPPED})  # dependants may run
BROKEN = frozenset({StageState.FAILED, StageState.KILLED, StageState.UPSTREAM_FAILED})
LIVE = frozenset({StageState.RUNNING, StageState.PAUSED, StageState.READY})  # a process group exists


@dataclass
class StageRow:
    """One stage as ``state.json`` records it (the fields both the supervisor and the console keep)."""

    id: str
    family: str
    dataset: str | None = None
    state: StageState = StageState.PENDING
    attempt: int = 1
    pid: int | None = None
    pgid: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    returncode: int | None = None
    reason: str = ""  # why it failed / why it waits
    health: HealthState | None = None
    pausing: bool = False
    retry_at: float | None = None
    service: bool = False
    gpus: list[int] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    uses: list[str] = field(default_factory=list)
    run: str | None = None  # the built-in stage's short name, None for an operator command
    job: str | None = None  # the Slurm executor: the attempt's Slurm job id
    forced: bool = (
        False  # ``aerie force`` is armed for this attempt (not started yet; ``force --cancel`` disarms)
    )
    # what front ends show, decided by the supervisor (display_of): never parsed from ``reason``'s prose
    display: DisplayState | str = ""
    queued: bool = False  # launched, waiting in the batch system's queue (or being submitted to it)

    def update_from(self, d: dict[str, Any]) -> None:
        """Take every row field ``d`` (a ``state.json`` row) has; a state this version does not know is
        kept as the string it is (a newer supervisor may have more)."""
        for f in _SETTABLE.intersection(d):
            setattr(self, f, d[f])
        if "state" in d:
            try:
                self.state = StageState(d["state"])
            except ValueError:
                self.state = d["state"]
        if d.get("health") is not None:
            try:
                self.health = HealthState(d["health"])
            except ValueError:
                self.health = d["health"]
        if d.get("display"):
            try:
                self.display = DisplayState(d["display"])
            except ValueError:
                self.display = d["display"]

    @property
    def force_armed(self) -> bool:
        """``aerie force`` armed on a stage that has not started yet (shown, and disarmable, until it starts)."""
        return self.forced and self.state in (StageState.PENDING, StageState.READY)

    @property
    def display_state(self) -> DisplayState | str:
        """What front ends show: the snapshot's ``display`` field; for a row from a snapshot older than it
        (:data:`pipeline.run.rundir.state_file.SNAPSHOT_VERSION` 1), :func:`display_of` its state."""
        return self.display or display_of(self)


ROW_FIELDS = tuple(f.name for f in fields(StageRow))
_SETTABLE = frozenset(ROW_FIELDS) - {"id", "family"}  # what a state.json row may set (its id is its key)


def display_of(row: StageRow, starting: bool = False) -> DisplayState | str:
    """The display state of ``row`` (the supervisor's word, written to ``state.json``'s ``display``): for a
    running stage pausing, a service's health, or starting (``starting``: the executor says its process or
    job has not begun its work; ``row.queued``: waiting in Slurm's queue); else its state. A state this
    version does not know, as it is."""
    if row.state == StageState.RUNNING:
        if row.pausing:
            return DisplayState.PAUSING
        if row.service and row.health:
            return _display(row.health)
        if starting or row.queued:
            return DisplayState.STARTING
    return _display(row.state)


def _display(word: str) -> DisplayState | str:
    try:
        return DisplayState(word)
    except ValueError:
        return word
