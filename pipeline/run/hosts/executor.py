"""The executor seam: how a stage's attempt runs, is followed and is controlled.

The supervisor decides *what* happens (which stage starts, when a pause becomes a freeze, when a kill
becomes a hard kill); an :class:`Executor` carries it out for one kind of place an attempt runs:

* :class:`pipeline.run.hosts.local_exec.LocalProcesses` — a launcher process group on this host (``[executor]
  kind = "local"``): signals to the group Aerie started and recorded, and to the processes carrying
  the attempt's token that left it;
* :class:`pipeline.run.hosts.slurm.jobs.SlurmJobs` — a Slurm job per attempt (``kind = "slurm"``): ``scancel``,
  ``scontrol suspend``/``resume``, the job's state from ``squeue``/``sacct``.

A new executor (several SSH hosts, Kubernetes) implements this protocol and is named in
:func:`make_executor`; the supervisor itself does not change.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.run.plan.dag import Plan, StageSpec
    from pipeline.run.rundir.layout import RunDir, StageDir
    from pipeline.run.rundir.stage_status import StageStatus


class Executor(Protocol):
    kind: str
    """The plan's ``[executor] kind``."""
    uses_local_slots: bool
    """Whether the supervisor admits stages by this host's ``[resources]`` (CPU slots, GPU ids)."""
    freeze_how: str
    """How a stage that reached no safe point is frozen, for the operator's messages."""

    def launch(self, sid: str, attempt: int) -> None:
        """Start ``attempt`` of ``sid`` (its ``launch.json`` intent is already written)."""

    def derive(self, st: StageStatus, sd: StageDir, attempt: int, acked: bool) -> StageStatus | None:
        """The state of an attempt that was started (running, paused or finished, from its records and
        the executor's own view; ``acked``: the stage said it is paused at a safe point); None when this
        attempt was never started. :func:`pipeline.run.rundir.stage_status.finish` reads an exit record."""

    def freeze(self, sid: str) -> str | None:
        """Freeze the attempt where it is; None when done, else why it cannot be."""

    def thaw(self, sid: str, frozen: bool) -> None:
        """Let a paused attempt run again (``frozen``: :meth:`freeze` succeeded for it)."""

    def terminate(self, sid: str, frozen: bool, reason: str) -> str:
        """Ask the attempt to stop (it may clean up); returns what was done, for the operator."""

    def kill(self, sid: str) -> str:
        """Stop the attempt now (after the kill grace period); returns what was done."""

    def poll(self) -> None:
        """Housekeeping once a tick (reap finished children, re-send what could not be sent before)."""

    def survivors(self, sid: str) -> str | None:
        """What still runs of the stage's last started attempt, for the operator (its processes, its job);
        None when nothing does. The supervisor starts no attempt, and retries or skips none, while it says
        something: a stage never runs twice."""


def make_executor(
    plan: Plan,
    run: RunDir,
    specs: dict[str, StageSpec],
    log: Callable[[str], None],
    python: str = sys.executable,
) -> Executor:
    """The executor the plan names."""
    if plan.executor.kind == "slurm":
        from pipeline.run.hosts.slurm.jobs import SlurmJobs

        return SlurmJobs(run, specs, plan.settings.slurm, log, python)
    from pipeline.run.hosts.local_exec import LocalProcesses

    return LocalProcesses(run, specs, log, python)
