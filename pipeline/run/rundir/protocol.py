"""The run protocol, typed: one frozen dataclass per event kind and the one decoder from a line's
:class:`~pipeline.run.rundir.events.Event` to it.

:mod:`pipeline.run.rundir.events` owns the wire (one JSON object a line, bounds, rotation, the tail); this
module owns what a line *means*. Every reader — the supervisor's state deriver, the console's model, ``aerie
status``, the alert rules — calls :func:`decode` and dispatches on the class (``match ev: case Metric(): …``),
never on the ``type`` string, so a kind or a field is named in one place and a typo is a type error.

A kind this version does not know (written by a newer stage or launcher) decodes to :class:`Unknown`: kept,
shown in the event list (:func:`describe`), never dropped, and ignored by the reducer
(:mod:`pipeline.run.rundir.stage_reducer`). Fields a kind does not declare stay in ``data`` (the raw event's
fields), so nothing a stage wrote is lost either. Standard library only: the console and the container
import it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.run.rundir.event_lines import CARRIED
from pipeline.run.rundir.events import Event

# message codes the run machinery reads (a message without a code is prose for the operator)
PAUSED, RESUMED, FORCED, SKIPPED_LINE = "paused", "resumed", "forced", "skipped-line"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _step(v: Any) -> int | float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclass(frozen=True, slots=True)
class Started:
    """``started {attempt, pid}``: the launcher began attempt ``attempt`` (written by the launcher)."""

    t: float
    attempt: int | None = None
    pid: int | None = None
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Progress:
    """``progress {done, total?, unit?, key?}``; ``key`` names a sub-task (a dataset); ``rejects`` (a prep's
    rejected rows) or ``failed`` (a regeneration's given-up requests) ride along as ``bad``."""

    t: float
    done: float
    total: float | None = None
    unit: str = ""
    key: str | None = None
    bad: int | None = None
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Metric:
    """``metric {name, value, step?, label?}``; ``value`` may be NaN or ±inf (a diverged loss): kept as it is."""

    t: float
    name: str
    value: float
    step: int | float | None = None  # as written (an int stays an int)
    label: str | None = None
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def series(self) -> str:
        """The curve it belongs to: ``name``, or ``name/label`` (one curve per label, e.g. per dataset)."""
        return f"{self.name}/{self.label}" if self.label else self.name

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value)


@dataclass(frozen=True, slots=True)
class Message:
    """``message {level, text, code?}``; ``code`` marks one the machinery reads (:data:`PAUSED`, …)."""

    t: float
    text: str
    level: str = "info"
    code: str | None = None
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Health:
    """``health {state}``: a service's probe result (``starting`` | ``ready`` | ``unhealthy`` | ``stopped``)."""

    t: float
    state: str
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Finished:
    """``finished {status, returncode?, detail?, error?}``: the attempt ended (written by the launcher, or the
    supervisor for one whose launcher died)."""

    t: float
    status: str
    returncode: int | None = None
    detail: str | None = None
    error: str | None = None
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Unknown:
    """An event of a kind this version does not know: kept with all its fields and shown as written."""

    t: float
    kind: str
    carried: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, repr=False)


RunEvent = Started | Progress | Metric | Message | Health | Finished | Unknown
KINDS: dict[str, type] = {
    "started": Started,
    "progress": Progress,
    "metric": Metric,
    "message": Message,
    "health": Health,
    "finished": Finished,
}


def decode(ev: Event) -> RunEvent:
    """The typed event of one wire event (:func:`pipeline.run.rundir.events.decode` has validated the fields
    its kind needs); an unknown kind is :class:`Unknown`, never an error."""
    d, t, carried = ev.data, ev.t, bool(ev.data.get(CARRIED))
    match ev.type:
        case "started":
            return Started(t, _int(d.get("attempt")), _int(d.get("pid")), carried, d)
        case "progress":
            bad = _int(d.get("rejects", d.get("failed")))
            return Progress(
                t,
                _num(d.get("done")) or 0.0,
                _num(d.get("total")),
                _str(d.get("unit")) or "",
                _str(d.get("key")),
                bad,
                carried,
                d,
            )
        case "metric":
            value = _num(d.get("value"))
            return Metric(
                t,
                str(d.get("name")),
                math.nan if value is None else value,
                _step(d.get("step")),
                _str(d.get("label")) or None,
                carried,
                d,
            )
        case "message":
            code = _str(d.get("code")) or None
            return Message(t, str(d.get("text", "")), str(d.get("level", "info")), code, carried, d)
        case "health":
            return Health(t, str(d.get("state")), carried, d)
        case "finished":
            return Finished(
                t,
                str(d.get("status")),
                _int(d.get("returncode")),
                _str(d.get("detail")),
                _str(d.get("error")),
                carried,
                d,
            )
    return Unknown(t, ev.type, carried, d)


def decode_all(events: list[Event]) -> list[RunEvent]:
    return [decode(ev) for ev in events]


def kind_of(ev: RunEvent) -> str:
    """The wire name of ``ev``'s kind (``"metric"``, or an unknown kind's own word)."""
    return ev.kind if isinstance(ev, Unknown) else next(k for k, c in KINDS.items() if isinstance(ev, c))


def to_event(ev: RunEvent) -> Event:
    """The wire event again (for a line shown as written)."""
    return Event(kind_of(ev), ev.t, dict(ev.data))


def fmt_value(v: float) -> str:
    """A metric value as the console writes it: 4 significant digits, ``nan``/``inf``/``-inf`` as such."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"


def describe(ev: RunEvent) -> str:
    """One human line for an event (the detail pane, headless output)."""
    match ev:
        case Started():
            return f"started attempt {ev.attempt} (pid {ev.pid})"
        case Finished():
            rc = ev.returncode
            return (
                f"finished: {ev.status}"
                + (f" (rc {rc})" if rc not in (None, 0) else "")
                + (f" {ev.detail}" if ev.detail else "")
                + (f": {ev.error}" if ev.error else "")
            )
        case Metric():
            raw = ev.data.get("value")
            shown = str(raw) if isinstance(raw, int) and not isinstance(raw, bool) else fmt_value(ev.value)
            return f"{ev.name} = {shown}"
        case Message():
            return (f"{ev.level}: " if ev.level != "info" else "") + ev.text
        case Health():
            return f"health: {ev.state}"
        case Progress():
            total = ev.data.get("total")
            return f"{ev.data.get('done')}/{total} {ev.unit}"
    return f"{ev.kind} (an event kind this version does not know): {to_event(ev).to_json()}"
