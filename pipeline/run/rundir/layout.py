"""The run directory: layout, atomic state files and control requests.

The run directory on the executing host is the single source of truth. Layout::

    RUN/
      plan.toml                 frozen copy of the plan the run was created from
      state.json                the supervisor's latest snapshot of every stage (derived, rewritable)
      supervisor.json           pid/pgid/start time of the live supervisor; supervisor.lock (flock)
      supervisor.log
      requests/<ts>-<n>.json    control requests (pause/resume/kill/retry), consumed by the supervisor
      audit.jsonl               every control action: who, from which front end, its outcome (append-only)
      stages/<id>/
        spec.json               the expanded stage spec
        attempt.json            current attempt number (+ fresh flag) — bumped by retry
        launch.json             the supervisor's intent to launch attempt N (written before spawning)
        proc.json               launcher's pid + pgid + start time for attempt N
        exit.json               launcher's exit record for attempt N
        events.jsonl            append-only events of every attempt
        stage.log               stdout+stderr of every attempt, with a banner per attempt
        pause                   present while a pause is requested (the stage polls it)
        kill.json               present when a kill was requested for attempt N
        force.json              admission checks overridden for attempt N (``--force``)
        slurm.json              Slurm executor: job name, then job id, of attempt N (before and after sbatch)
        job-<N>.sh              Slurm executor: the batch script of attempt N
        out/                    the stage's outputs (``--fresh`` clears this, nothing else)

Everything Aerie creates here is private to the run's account whatever the umask: directories 0700,
files 0600 (:func:`pipeline.run.rundir.files.private_dir`, :func:`~pipeline.run.rundir.files.open_private`; stages run
under umask 077, so what their libraries write is too). Events, logs and the audit log rotate by size
into numbered generations (``events.1.jsonl``, ``stage.1.log``, ``audit.1.jsonl``, ``supervisor.1.log``):
:mod:`pipeline.run.rundir.growth` has the limits.

Every JSON state file is written atomically (temp file in the same directory, fsync, rename), by
:mod:`pipeline.run.rundir.files`; ``write_atomic``, ``write_json`` and ``read_json`` are imported from here too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.run.rundir.files import private_dir, read_json, write_atomic, write_json

__all__ = ["RunDir", "RunDirError", "StageDir", "read_json", "write_atomic", "write_json"]

STAGE_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class RunDirError(RuntimeError):
    pass


class RunDir:
    """Paths and small file operations on one run directory."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().absolute()

    # -- layout -----------------------------------------------------------------------------
    @property
    def plan_path(self) -> Path:
        return self.root / "plan.toml"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def supervisor_path(self) -> Path:
        return self.root / "supervisor.json"

    @property
    def lock_path(self) -> Path:
        return self.root / "supervisor.lock"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def requests_dir(self) -> Path:
        return self.root / "requests"

    @property
    def stages_dir(self) -> Path:
        return self.root / "stages"

    def stage(self, stage_id: str) -> StageDir:
        if not stage_id or not set(stage_id) <= STAGE_ID_CHARS or stage_id.startswith("."):
            raise RunDirError(f"invalid stage id {stage_id!r}")
        return StageDir(self.stages_dir / stage_id, stage_id)

    def exists(self) -> bool:
        return self.plan_path.is_file() and self.stages_dir.is_dir()

    def stage_ids(self) -> list[str]:
        """Stage ids in plan order (the order recorded in state.json, else spec files)."""
        order = read_json(self.root / "order.json")
        if order:
            return list(order)
        if not self.stages_dir.is_dir():
            return []
        return sorted(p.name for p in self.stages_dir.iterdir() if (p / "spec.json").is_file())

    def inside(self, path: Path) -> bool:
        """True when ``path`` resolves to somewhere inside this run directory."""
        try:
            Path(path).resolve().relative_to(self.root.resolve())
            return True
        except ValueError:
            return False

    # -- control requests -------------------------------------------------------------------
    def submit_request(self, action: str, stage_id: str, **extra: Any) -> Path:
        """Queue a control request for the supervisor (atomic; names sort in arrival order)."""
        private_dir(self.requests_dir)
        name = f"{time.time_ns():020d}-{os.getpid()}-{action}.json"
        path = self.requests_dir / name
        write_json(path, {"action": action, "stage": stage_id, "t": time.time(), **extra})
        return path

    def pending_requests(self) -> Iterator[tuple[Path, dict]]:
        if not self.requests_dir.is_dir():
            return
        for p in sorted(self.requests_dir.glob("*.json")):
            try:
                yield p, json.loads(p.read_text())
            except (ValueError, FileNotFoundError):
                continue


class StageDir:
    """The files of one stage."""

    def __init__(self, path: Path, stage_id: str) -> None:
        self.path = path
        self.id = stage_id

    spec = property(lambda self: self.path / "spec.json")
    attempt_file = property(lambda self: self.path / "attempt.json")
    launch = property(lambda self: self.path / "launch.json")
    proc = property(lambda self: self.path / "proc.json")
    exit = property(lambda self: self.path / "exit.json")
    events = property(lambda self: self.path / "events.jsonl")
    log = property(lambda self: self.path / "stage.log")
    pause_flag = property(lambda self: self.path / "pause")
    kill_marker = property(lambda self: self.path / "kill.json")
    force_marker = property(lambda self: self.path / "force.json")
    slurm_job = property(lambda self: self.path / "slurm.json")
    out = property(lambda self: self.path / "out")

    def attempt(self) -> int:
        return int((read_json(self.attempt_file) or {}).get("attempt", 1))

    def record_for(self, path: Path, attempt: int) -> dict | None:
        """A per-attempt record (launch/proc/exit/kill) if it belongs to ``attempt``."""
        rec = read_json(path)
        if rec and int(rec.get("attempt", 0)) == attempt:
            return rec
        return None

    def clear_outputs(self, run: RunDir) -> None:
        """``--fresh``: remove this stage's outputs, refusing anything outside the run dir."""
        if not run.inside(self.out):
            raise RunDirError(f"refusing to delete {self.out}: outside the run directory {run.root}")
        if self.out.is_symlink():
            self.out.unlink()
        elif self.out.exists():
            import shutil  # rarely: not imported by every launcher

            shutil.rmtree(self.out)
        private_dir(self.out)
