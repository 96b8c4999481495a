"""A stage's state, derived from the files in its run directory (never from memory alone).

Each stage's launcher writes ``launch.json`` (intent), ``proc.json`` (pid, pgid, start time),
``exit.json`` and ``events.jsonl``; control writes ``kill.json``, ``skip.json`` and the pause flag.
:class:`StateDeriver` reads them for the current attempt and says what the stage is doing now, so
a new supervisor on an old run dir sees exactly what the last one saw.

States: pending -> ready -> running <-> paused -> succeeded | failed | killed; upstream-failed and
skipped. Services (``service = true``) are running until stopped; they report ``health``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.run.events import EventTail, EventWriter
from pipeline.run.plan import StageSpec
from pipeline.run.procs import ProcIdentity
from pipeline.run.rundir import RunDir, StageDir, write_json

TERMINAL = ("succeeded", "failed", "killed", "upstream-failed", "skipped")
SATISFIED = ("succeeded", "skipped")
BROKEN = ("failed", "killed", "upstream-failed")
LAUNCH_TIMEOUT_S = 30.0


@dataclass
class StageStatus:
    """The derived state of one stage, as written to ``state.json``."""

    id: str
    family: str
    dataset: str | None
    state: str = "pending"
    attempt: int = 1
    pid: int | None = None
    pgid: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    returncode: int | None = None
    reason: str = ""  # why it failed / why it waits
    health: str | None = None
    progress: dict[str, Any] | None = None
    pausing: bool = False
    retry_at: float | None = None
    service: bool = False
    gpus: list[int] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    uses: list[str] = field(default_factory=list)
    run: str | None = None  # the built-in module, None for an operator command
    job: str | None = None  # the Slurm executor: the attempt's Slurm job id


@dataclass
class EventMemory:
    """What is remembered from a stage's event stream (current attempt only)."""

    tail: EventTail
    attempt_seen: int = 0
    health: str | None = None
    progress: dict[str, Any] | None = None
    paused_ack_t: float = 0.0


class StateDeriver:
    """Derives each stage's :class:`StageStatus` from its files; records a launch that was lost."""

    def __init__(
        self, run: RunDir, specs: dict[str, StageSpec], log: Callable[[str], None], jobs: Any = None
    ) -> None:
        self.run = run
        self.jobs = jobs  # the Slurm executor's SlurmJobs: attempts are Slurm jobs, not local processes
        self.specs = specs
        self.log = log
        self.memory = {sid: EventMemory(EventTail(run.stage(sid).events)) for sid in specs}

    def _read_events(self, sid: str) -> None:
        tr = self.memory[sid]
        chunk = tr.tail.read()
        for ev in chunk.events:
            if ev.type == "started":
                tr.attempt_seen = int(ev.get("attempt", 0))
                tr.health, tr.progress, tr.paused_ack_t = None, None, 0.0
            elif ev.type == "progress":
                tr.progress = {
                    "done": ev.get("done"),
                    "total": ev.get("total"),
                    "unit": ev.get("unit"),
                    "t": ev.t,
                }
            elif ev.type == "health":
                tr.health = ev.get("state")
            elif ev.type == "message" and ev.get("code") == "paused":
                tr.paused_ack_t = ev.t
            elif ev.type == "message" and ev.get("code") == "resumed":
                tr.paused_ack_t = 0.0

    def derive(
        self, sid: str, status: dict[str, StageStatus], child: subprocess.Popen | None = None
    ) -> StageStatus:
        """The state of ``sid`` now; ``status`` holds its upstream stages' fresh states."""
        spec = self.specs[sid]
        sd = self.run.stage(sid)
        attempt = sd.attempt()
        self._read_events(sid)
        tr = self.memory[sid]
        st = StageStatus(
            id=sid,
            family=spec.family,
            dataset=spec.dataset,
            attempt=attempt,
            service=spec.service,
            gpus=list(spec.gpus),
            after=list(spec.after),
            uses=list(spec.uses),
            run=spec.run,
        )
        current = tr.attempt_seen == attempt
        st.health = tr.health if current else None
        st.progress = tr.progress if current else None
        proc = sd.record_for(sd.proc, attempt)
        launch = sd.record_for(sd.launch, attempt)
        if self.jobs is not None:
            # Under Slurm the launcher's pid is on a node we may not see: the job's state says it all.
            done = self.jobs.derive(st, sd, attempt, current and tr.paused_ack_t > 0, self)
            if done is not None:
                return done
            proc = launch = None
        if proc:
            ident = ProcIdentity.from_dict(proc)
            st.pid, st.pgid, st.started_at = ident.pid, ident.pgid, proc.get("t")
            alive = ident.is_alive()
            ex = sd.record_for(sd.exit, attempt)
            if alive and ex is None:
                pause = sd.pause_flag.exists()
                acked = current and tr.paused_ack_t > 0
                st.state = "paused" if pause and (acked or ident.is_stopped()) else "running"
                st.pausing = pause and st.state == "running"
                return st
            if ex is None:
                ex = self.record_lost(sid, attempt, "the stage's launcher died without recording an exit")
            return self._finished(st, sd, ex, attempt)
        if launch:
            ex = sd.record_for(sd.exit, attempt)
            if ex:
                return self._finished(st, sd, ex, attempt)
            child = child
            age = time.time() - float(launch.get("t", 0))
            if (child is not None and child.poll() is not None) or (child is None and age > LAUNCH_TIMEOUT_S):
                ex = self.record_lost(sid, attempt, "the launcher never reported its pid")
                return self._finished(st, sd, ex, attempt)
            st.state, st.reason = "running", "starting"
            return st
        # Not started in this attempt.
        if spec.skip or sd.record_for(sd.path / "skip.json", attempt):
            st.state = "skipped"
            return st
        return self._waiting(st, spec, status)

    def _finished(self, st: StageStatus, sd: StageDir, ex: dict, attempt: int) -> StageStatus:
        st.finished_at = ex.get("t")
        st.returncode = ex.get("returncode")
        killed = sd.record_for(sd.kill_marker, attempt)
        if st.returncode == 0 or (killed and killed.get("reason") == "stop"):
            st.state = "succeeded"
        elif killed:
            st.state, st.reason = "killed", killed.get("reason", "operator")
        else:
            st.state = "failed"
            st.reason = ex.get("detail") or (f"exit {st.returncode}" if st.returncode is not None else "lost")
            if ex.get("error"):
                st.reason += f": {ex['error']}"  # the log line that says why
            spec = self.specs[st.id]
            if attempt < spec.retry.max_attempts:
                st.retry_at = float(ex.get("t", time.time())) + spec.retry.backoff_s * (2 ** (attempt - 1))
        st.pausing = False
        return st

    def record_lost(self, sid: str, attempt: int, why: str) -> dict:
        sd = self.run.stage(sid)
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
            w.emit("finished", status="killed" if killed else "failed", detail=why)
        self.log(f"{sid}: attempt {attempt}: {why}")
        return ex

    def _waiting(self, st: StageStatus, spec: StageSpec, status: dict[str, StageStatus]) -> StageStatus:
        deps = [(d, status.get(d)) for d in spec.after]
        for d, ds in deps:
            if ds and ds.state in BROKEN and ds.retry_at is None:
                st.state, st.reason = "upstream-failed", f"{d} {ds.state}"
                return st
        for u in spec.uses:
            us = status.get(u)
            if us and us.state in TERMINAL and us.state != "skipped":
                st.state, st.reason = "upstream-failed", f"service {u} {us.state}"
                return st
        waiting = [d for d, ds in deps if not ds or ds.state not in SATISFIED]
        if waiting:
            st.state, st.reason = (
                "pending",
                "after " + ", ".join(waiting[:3]) + (" …" if len(waiting) > 3 else ""),
            )
            return st
        for u in spec.uses:
            us = status.get(u)
            if not us or us.state != "running" or us.health != "ready":
                st.state, st.reason = "pending", f"waiting for {u} to be ready"
                return st
        st.state = "ready"
        return st
