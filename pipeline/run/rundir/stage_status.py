"""A stage's status row (what ``state.json`` says of it) and how an ended attempt reads.

Shared by the state deriver (:mod:`pipeline.run.supervise.stage_state`) and the executors
(:mod:`pipeline.run.hosts.local_exec`, :mod:`pipeline.run.hosts.slurm.jobs`), which say when an attempt has ended;
what an exit record means — succeeded, killed, failed and when to retry — is decided here, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.run.plan.dag import StageSpec
from pipeline.run.rundir.events import EventWriter
from pipeline.run.rundir.layout import StageDir, write_json
from pipeline.run.rundir.stage_row import ExitStatus, StageRow, StageState


@dataclass
class StageStatus(StageRow):
    """The derived state of one stage, as written to ``state.json``: the row and its last progress event."""

    progress: dict[str, Any] | None = None


def finish(st: StageStatus, sd: StageDir, ex: dict, attempt: int, spec: StageSpec) -> StageStatus:
    """``st`` for an attempt whose exit record is ``ex``: succeeded, killed or failed (and when to retry)."""
    st.finished_at = ex.get("t")
    st.returncode = ex.get("returncode")
    killed = sd.record_for(sd.kill_marker, attempt)
    if st.returncode == 0 or (killed and killed.get("reason") == "stop"):
        st.state = StageState.SUCCEEDED
    elif killed:
        st.state, st.reason = StageState.KILLED, killed.get("reason", "operator")
    else:
        st.state = StageState.FAILED
        st.reason = ex.get("detail") or (f"exit {st.returncode}" if st.returncode is not None else "lost")
        if ex.get("error"):
            st.reason += f": {ex['error']}"  # the log line that says why
        if attempt < spec.retry.max_attempts:
            st.retry_at = float(ex.get("t", time.time())) + spec.retry.backoff_s * (2 ** (attempt - 1))
    st.pausing = False
    return st


def record_lost(sd: StageDir, attempt: int, why: str, log: Callable[[str], None]) -> dict:
    """Write the exit record of an attempt that ended without one (its launcher died, its job vanished)."""
    # Re-read: the launcher may have written it between our checks.
    ex = sd.record_for(sd.exit, attempt)
    if ex:
        return ex
    killed = sd.record_for(sd.kill_marker, attempt)
    ex = {
        "attempt": attempt,
        "returncode": None,
        "signal": "KILL" if killed else None,
        "t": time.time(),
        "detail": why,
        "recorded_by": "supervisor",
    }
    write_json(sd.exit, ex)
    with EventWriter(sd.events) as w:
        w.emit("finished", status=ExitStatus.KILLED if killed else ExitStatus.FAILED, detail=why)
    log(f"{sd.id}: attempt {attempt}: {why}")
    return ex
