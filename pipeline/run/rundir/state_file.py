"""Reading ``RUN/state.json`` for a front end (``ctl status``, ``aerie status``): the supervisor's snapshot, or,
when that file is truncated or not valid JSON, one line saying so and what is shown instead.

The supervisor writes ``state.json`` atomically, so a torn one is rare (a disk, a copy, a hand); it rewrites
the file every tick, so the problem heals itself while a supervisor runs. Meanwhile :func:`read_state` shows
each stage from its own files (its attempt, its exit record, a skip or a launch), which is what a new supervisor
would start from too — coarser than the snapshot (no progress, no reasons), never a traceback.
"""

from __future__ import annotations

from typing import Any

from pipeline.run.rundir.layout import RunDir, RunDirError, read_json
from pipeline.run.rundir.stage_row import ExitStatus, StageState

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
