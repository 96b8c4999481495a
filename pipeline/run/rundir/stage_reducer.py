"""The one reducer from a stage's events to what they say of its row: :class:`StageFacts`.

A stage's ``events.jsonl`` says which attempt is running (``started``), how far it got (``progress``), a
service's health, whether a pause was acknowledged (``message`` coded ``paused``/``resumed``), each metric's
latest value and how the attempt ended (``finished``). :meth:`StageFacts.apply` folds one typed event
(:mod:`pipeline.run.rundir.protocol`) into them; a ``started`` event starts the facts over (a new attempt).
The supervisor's state deriver (:mod:`pipeline.run.supervise.stage_state`) puts them into the stage's row
(:class:`~pipeline.run.rundir.stage_row.StageRow`) with what the executor says; the alert rules read them.
The console does not reduce progress itself: it reads the row from ``state.json`` (one route for each fact)
and the events only for its curves, metrics and logs. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.run.rundir.protocol import (
    PAUSED,
    RESUMED,
    Finished,
    Health,
    Message,
    Metric,
    Progress,
    RunEvent,
    Started,
)
from pipeline.run.rundir.stage_row import HealthState


@dataclass
class StageFacts:
    """What a stage's events say of its current attempt (the latest ``started`` on)."""

    attempt: int = 0  # the attempt of the latest ``started`` event (0: none seen)
    pid: int | None = None
    started_t: float | None = None
    health: HealthState | None = None
    progress: Progress | None = None  # the latest progress event (any key)
    paused_ack_t: float = 0.0  # when the stage acknowledged a pause (0: not paused)
    finished: Finished | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # latest value per name (any label), NaN/inf kept
    metric_t: float = 0.0  # when the latest metric was reported (0: none in this attempt)
    bad: int = 0  # rows a prep rejected / requests a regeneration gave up on
    last_t: float = 0.0  # the time of the latest event applied

    def apply(self, ev: RunEvent) -> None:
        """Fold one event in (in file order). An unknown kind changes nothing."""
        self.last_t = max(self.last_t, ev.t)
        match ev:
            case Started():
                # a new attempt: nothing of the last one holds
                fresh = StageFacts(attempt=ev.attempt or 0, pid=ev.pid, started_t=ev.t, last_t=ev.t)
                self.__dict__.update(fresh.__dict__)
            case Progress():
                self.progress = ev  # the latest in file order (the stream is append-only), whatever its t
                if ev.bad is not None:
                    self.bad = ev.bad
            case Metric():
                self.metrics[ev.name] = ev.value
                self.metric_t = max(self.metric_t, ev.t)
                if ev.name == "rejects" and ev.finite:
                    self.bad = int(ev.value)
            case Health():
                try:
                    self.health = HealthState(ev.state)
                except ValueError:
                    self.health = None
            case Message(code=code) if code == PAUSED:
                self.paused_ack_t = ev.t
            case Message(code=code) if code == RESUMED:
                self.paused_ack_t = 0.0
            case Finished():
                self.finished = ev

    def apply_all(self, events: list[RunEvent]) -> StageFacts:
        for ev in events:
            self.apply(ev)
        return self

    def progress_row(self) -> dict[str, Any] | None:
        """The row's ``progress`` field (``state.json``): ``{done, total, unit, t}`` of the latest report."""
        p = self.progress
        if p is None:
            return None
        return {
            "done": p.data.get("done", p.done),
            "total": p.data.get("total"),
            "unit": p.data.get("unit"),
            "t": p.t,
        }
