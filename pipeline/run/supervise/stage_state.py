"""A stage's state, derived from the files in its run directory (never from memory alone).

Each stage's launcher writes ``launch.json`` (intent), ``proc.json`` (pid, pgid, start time, attempt token),
``exit.json`` and ``events.jsonl``; control writes ``kill.json``, ``skip.json`` and the pause flag.
:class:`StateDeriver` reads them for the current attempt and says what the stage is doing now, so
a new supervisor on an old run dir sees exactly what the last one saw.

States: pending -> ready -> running <-> paused -> succeeded | failed | killed; upstream-failed and
skipped. Services (``service = true``) are running until stopped; they report ``health``. An attempt is
running while any of its processes lives, its launcher or not (a launcher killed alone: the executor follows
the stage's own processes, :mod:`pipeline.run.hosts.local_exec`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.run.plan.dag import StageSpec
from pipeline.run.rundir.events import EventTail
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.protocol import decode_all
from pipeline.run.rundir.stage_reducer import StageFacts
from pipeline.run.rundir.stage_row import (
    BROKEN,
    SATISFIED,
    TERMINAL,
    DisplayState,
    HealthState,
    StageState,
    display_of,
)
from pipeline.run.rundir.stage_status import StageStatus

if TYPE_CHECKING:
    from pipeline.run.hosts.executor import Executor

# reads of an ended attempt's events in one tick (each at most a window; the rest next tick)
READ_TO_END_CALLS = 64


@dataclass
class EventMemory:
    """What is remembered from a stage's event stream: its tail and the reduced facts (current attempt)."""

    tail: EventTail
    facts: StageFacts = field(default_factory=StageFacts)
    drained_attempt: int = 0  # an ended attempt whose events were read to their end


class StateDeriver:
    """Derives each stage's :class:`StageStatus` from its files: its events here, the attempt's own state
    from the executor, and from the plan why a stage that has not started waits."""

    def __init__(
        self, run: RunDir, specs: dict[str, StageSpec], log: Callable[[str], None], executor: Executor
    ) -> None:
        self.run = run
        self.executor = (
            executor  # what an attempt that was started is doing: its process group, its Slurm job
        )
        self.specs = specs
        self.log = log
        self.memory = {sid: EventMemory(EventTail(run.stage(sid).events)) for sid in specs}

    def _read_events(self, sid: str) -> None:
        tr = self.memory[sid]
        chunk = tr.tail.read()
        for bad in chunk.bad_lines[:5]:  # an over-long line skipped, a torn fragment: said once, then passed
            self.log(f"{sid}: warning: events.jsonl: {bad}")
        if len(chunk.bad_lines) > 5:
            self.log(
                f"{sid}: warning: events.jsonl: {len(chunk.bad_lines) - 5} more lines that are not events"
            )
        tr.facts.apply_all(decode_all(chunk.events))

    def _read_to_end(self, sid: str) -> None:
        """Every event of an attempt that has ended (it writes no more): reads until the offset stops."""
        tail = self.memory[sid].tail
        for _ in range(READ_TO_END_CALLS):
            before = tail.offset
            self._read_events(sid)
            if tail.offset == before:
                return

    def derive(self, sid: str, status: dict[str, StageStatus]) -> StageStatus:
        """The state of ``sid`` now, with its display state (an executor marks a process or job that has
        not begun its work ``starting``); ``status`` holds its upstream stages' fresh states."""
        st = self._derive(sid, status)
        st.display = display_of(st, starting=st.display == DisplayState.STARTING)
        return st

    def _derive(self, sid: str, status: dict[str, StageStatus]) -> StageStatus:
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
        current = tr.facts.attempt == attempt
        st.health = tr.facts.health if current else None
        st.progress = tr.facts.progress_row() if current else None
        done = self.executor.derive(st, sd, attempt, acked=current and tr.facts.paused_ack_t > 0)
        if done is not None and done.state in TERMINAL and tr.drained_attempt != attempt:
            # The events were read before the executor saw the attempt end: what it wrote in between
            # (its last progress, read slowly past an over-long line) is read now, all of it, so the
            # final snapshot (the one a finished run's supervisor exits on) is its last word.
            self._read_to_end(sid)
            tr.drained_attempt = attempt
            current = tr.facts.attempt == attempt
            done.health = tr.facts.health if current else None
            done.progress = tr.facts.progress_row() if current else None
        if done is not None:
            return done
        # Not started in this attempt.
        if spec.skip or sd.record_for(sd.path / "skip.json", attempt):
            st.state = StageState.SKIPPED
            return st
        return self._waiting(st, spec, status)

    def _waiting(self, st: StageStatus, spec: StageSpec, status: dict[str, StageStatus]) -> StageStatus:
        deps = [(d, status.get(d)) for d in spec.after]
        for d, ds in deps:
            if ds and ds.state in BROKEN and ds.retry_at is None:
                st.state, st.reason = StageState.UPSTREAM_FAILED, f"{d} {ds.state}"
                return st
        for u in spec.uses:
            us = status.get(u)
            if us and us.state in TERMINAL and us.state != StageState.SKIPPED:
                st.state, st.reason = StageState.UPSTREAM_FAILED, f"service {u} {us.state}"
                return st
        waiting = [d for d, ds in deps if not ds or ds.state not in SATISFIED]
        if waiting:
            st.state, st.reason = (
                StageState.PENDING,
                "after " + ", ".join(waiting[:3]) + (" …" if len(waiting) > 3 else ""),
            )
            return st
        for u in spec.uses:
            us = status.get(u)
            if not us or us.state != StageState.RUNNING or us.health != HealthState.READY:
                st.state, st.reason = StageState.PENDING, f"waiting for {u} to be ready"
                return st
        st.state = StageState.READY
        return st
