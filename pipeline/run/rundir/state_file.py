"""Reading ``RUN/state.json`` for a front end (``ctl status``, ``aerie status``): the supervisor's snapshot, or,
when that file is truncated or not valid JSON, one line saying so and what is shown instead.

The supervisor writes ``state.json`` atomically, so a torn one is rare (a disk, a copy, a hand); it rewrites
the file every tick, so the problem heals itself while a supervisor runs. Meanwhile :func:`read_state` shows
each stage from its own files (its attempt, its exit record, a skip or a launch), which is what a new supervisor
would start from too — coarser than the snapshot (no progress, no reasons), never a traceback.

The snapshot itself is typed and versioned (:class:`StateSnapshot`, :data:`SNAPSHOT_VERSION`): one
:class:`~pipeline.run.rundir.stage_row.StageRow` per stage (every field, the display state included) and its
latest progress; front ends decode it with :meth:`StateSnapshot.from_dict` and show its rows as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.run.rundir.layout import RunDir, RunDirError, read_json
from pipeline.run.rundir.stage_row import ExitStatus, StageRow, StageState

# 1: rows without a version or a display state (the console derived "starting" from the reason's words);
# 2: "version", and each row's "display" and "queued" fields
SNAPSHOT_VERSION = 2


@dataclass
class SnapshotRow:
    """One stage in the snapshot: its row and its latest progress report (``{done, total, unit, t}``)."""

    row: StageRow
    progress: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every row field (no hand list: a field added to :class:`StageRow` is here at once), and progress."""
        return {**asdict(self.row), "progress": self.progress}


@dataclass
class StateSnapshot:
    """``state.json``: the supervisor's typed snapshot of the run, rewritten every tick (atomically)."""

    run: str = ""
    run_dir: str = ""
    executor: str = "local"
    supervisor: dict[str, Any] = field(default_factory=dict)  # {pid, t, alerts: [the supervisor's faults]}
    stages: list[SnapshotRow] = field(default_factory=list)
    done: bool = False
    version: int = SNAPSHOT_VERSION
    error: str | None = None  # the file could not be used: the rows are from the stages' own files

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "run": self.run,
            "run_dir": self.run_dir,
            "executor": self.executor,
            "supervisor": self.supervisor,
            "stages": [r.to_dict() for r in self.stages],
            "done": self.done,
        }
        if self.error:
            out["error"] = self.error
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StateSnapshot:
        """Decode a snapshot (any version so far); raises ``ValueError`` naming what is wrong."""
        if not isinstance(d, dict) or not isinstance(d.get("stages", []), list):
            raise ValueError("not a state snapshot")
        rows = []
        for i, r in enumerate(d.get("stages", [])):
            if not isinstance(r, dict) or not isinstance(r.get("id"), str):
                raise ValueError(f"stages[{i}]: a stage row without an id")
            row = StageRow(id=r["id"], family=str(r.get("family") or r["id"]))
            row.update_from(r)  # every row field it has (the rest keep their defaults)
            prog = r.get("progress")
            rows.append(SnapshotRow(row, prog if isinstance(prog, dict) else None))
        sup = d.get("supervisor")
        version = d.get("version", 1)
        return cls(
            run=str(d.get("run") or ""),
            run_dir=str(d.get("run_dir") or ""),
            executor=str(d.get("executor") or "local"),
            supervisor=sup if isinstance(sup, dict) else {},
            stages=rows,
            done=bool(d.get("done")),
            version=version if isinstance(version, int) else 1,
            error=d["error"] if isinstance(d.get("error"), str) else None,
        )


STATE_PROBLEM = (
    "{path} is truncated or not valid JSON (written by a supervisor that died mid-write?): "
    "showing stages from their own files; waiting for the supervisor's next snapshot "
    "(it rewrites the file every tick)"
)


def read_state(run: RunDir) -> tuple[dict[str, Any], str | None]:
    """``(state.json's snapshot, None)``; ``({"stages": <rows from the stages' files>}, problem)`` when the file
    cannot be used; ``({"stages": []}, None)`` before the supervisor's first snapshot."""
    try:
        snap = read_json(run.state_path)
        if snap is None:
            return {"stages": []}, None
        if not isinstance(snap, dict) or not isinstance(snap.get("stages", []), list):
            raise ValueError("not a state snapshot")
        if all(isinstance(s, dict) and isinstance(s.get("id"), str) for s in snap.get("stages", [])):
            return snap, None
        raise ValueError("a stage row without an id")
    except (ValueError, UnicodeDecodeError):
        problem = STATE_PROBLEM.format(path=run.state_path)
    except OSError as exc:  # unreadable (permissions, I/O error): say which and why
        problem = (
            f"{run.state_path}: cannot be read ({exc.strerror or exc}): showing stages from their own files"
        )
    return {"stages": rows_from_files(run), "error": problem}, problem


def rows_from_files(run: RunDir) -> list[dict[str, Any]]:
    """One coarse row per stage, in plan order, from its own files: ``succeeded``/``failed``/``killed`` from the
    current attempt's exit record, ``skipped``, ``started`` (launched, no exit yet), else ``waiting``."""
    rows = []
    try:
        ids = run.stage_ids()
    except (ValueError, OSError):
        ids = []
    for sid in ids:
        row: dict[str, Any] = {"id": sid, "state": "unknown", "attempt": 0, "reason": "from its files"}
        try:
            sd = run.stage(sid)
            attempt = sd.attempt()
            row["attempt"] = attempt
            ex = sd.record_for(sd.exit, attempt)
            if ex is not None:
                rc = ex.get("returncode")
                row["returncode"] = rc
                row["state"] = (
                    ExitStatus.SUCCEEDED
                    if rc == 0
                    else ExitStatus.KILLED
                    if sd.record_for(sd.kill_marker, attempt)
                    else ExitStatus.FAILED
                )
            elif sd.record_for(sd.path / "skip.json", attempt):
                row["state"] = StageState.SKIPPED
            elif sd.record_for(sd.proc, attempt) or sd.record_for(sd.launch, attempt):
                row["state"] = "started"
            else:
                row["state"] = "waiting"
        except (ValueError, OSError, RunDirError, TypeError) as exc:
            row["reason"] = f"its files cannot be read: {exc}"
        rows.append(row)
    return rows
