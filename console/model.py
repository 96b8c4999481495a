"""The console's run model: what the widgets read, built from the run directory through a transport.

Each :meth:`RunModel.poll` asks the transport for what was appended since the last poll:
``state.json`` (the supervisor's snapshot of every stage), each stage's ``events.jsonl`` from its
byte offset, and the log tail of the stages being watched. Memory is bounded whatever the run's
length: per stage the latest state, the latest value of each metric, each metric's history for the
curves (downsampled, see :mod:`console.series`), a bounded window of progress samples (for rate and
ETA), the last events and the last log lines. On attach the model starts
near the end of long event files instead of replaying days of history; the curves then read the
skipped head back in the background, a chunk per poll (see :meth:`RunModel._backfill_step`).

Events files rotate past a size limit (:mod:`pipeline.run.rundir.growth`): when a stage's ``events.jsonl``
has a new inode the stream first reads the rest of the old generation (``events.1.jsonl``, or further:
the one with the old inode), then the new file from its start, skipping its *carried* lines (copies of
what it has already seen); none is lost or applied twice (:func:`console.streams.follow_rotation`). The curves' read-back
covers the current generation only.

Widgets never see the transport: they read :class:`StageView` objects and redraw when
:meth:`poll` reports that something changed. Listeners (``RunModel.listeners``) see each event as it is
applied, so they work incrementally. The run's alerts come from its records (:mod:`console.alert_feed`).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from console.alert_feed import AlertFeed
from console.series import StageHistory
from console.streams import Stream, consume, drop_carried, follow_rotation
from console.telemetry_model import TelemetryModel, find_telemetry_stage, telemetry_path
from console.transport import ReadResult, Transport, read_whole
from pipeline.run.rundir.event_lines import LineSkipper
from pipeline.run.rundir.events import Event, parse_lines
from pipeline.run.rundir.stage_row import TERMINAL, StageRow, StageState

ATTACH_TAIL_BYTES = 256 << 10  # on attach, read at most this much of an events file's end
LOG_TAIL_BYTES = 64 << 10
BACKFILL_CHUNK = 2 << 20  # bytes of an events file's skipped head read per poll for the curves
READ_WINDOW = 1 << 20  # bytes of each file read per poll; a line longer than this is skipped with a warning
STATE_PROBLEM = (  # short: it must fit the status line at 80 columns; `aerie status` names the whole path
    "state.json is truncated or not valid JSON{at}: waiting for the supervisor's next snapshot "
    "({doing}; it rewrites the file every tick)"
)
RATE_WINDOW_S = 120.0


@dataclass
class Progress:
    done: float = 0.0
    total: float | None = None
    unit: str = ""
    t: float = 0.0
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def add(self, t: float, done: float, total: float | None, unit: str) -> None:
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()  # a new attempt restarted the count
        self.done, self.total, self.unit, self.t = done, total, unit or self.unit, t
        self.samples.append((t, done))

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    def rate(self) -> float | None:
        """Units per second over the recent window (None until two samples exist)."""
        if len(self.samples) < 2:
            return None
        t1, d1 = self.samples[-1]
        horizon = t1 - RATE_WINDOW_S
        t0, d0 = next(((t, d) for t, d in self.samples if t >= horizon), self.samples[0])
        if t1 <= t0:
            return None
        return (d1 - d0) / (t1 - t0)

    def eta_s(self) -> float | None:
        r = self.rate()
        if not r or r <= 0 or self.total is None:
            return None
        return max(0.0, (self.total - self.done) / r)


@dataclass
class StageView(StageRow):
    """Everything the board and the detail pane show about one stage: its ``state.json`` row, and what
    the console keeps beside it (progress rates, metrics, log tail, history)."""

    progress: Progress = field(default_factory=Progress)
    metrics: dict[str, float] = field(default_factory=dict)
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=50))
    log: deque[str] = field(default_factory=lambda: deque(maxlen=1000))
    log_total: int = 0  # lines ever appended to ``log`` (it is bounded; this is not)
    rejects: int = 0
    history: StageHistory = field(default_factory=StageHistory)  # every metric over steps/time, bounded
    ev_attempt: int | None = None  # the attempt the events being read belong to (from `started`)

    def elapsed_s(self, now: float | None = None) -> float | None:
        if self.started_at is None:
            return None
        end = self.finished_at if self.state in TERMINAL and self.finished_at else (now or time.time())
        return max(0.0, end - self.started_at)


class RunModel:
    """The run as the console knows it. Call :meth:`poll` periodically (from a worker)."""

    def __init__(self, transport: Transport, backfill: bool = True) -> None:
        self.transport = transport
        self.backfill = backfill  # read back the metric history skipped on attach (the console; not headless)
        self._backfill: dict[str, _Backfill] = {}
        self.run_name = ""
        self.run_dir = transport.run_root
        self.executor = "local"
        self.stages: dict[str, StageView] = {}
        self.order: list[str] = []
        self.supervisor_pid: int | None = None
        self.supervisor_t: float | None = None
        self.supervisor_alerts: list[dict] = []  # the supervisor's own faults (state.json)
        self.done = False
        self.error: str | None = None
        self._state_raw = b""
        self.state_problem: str | None = None  # state.json unreadable (STATE_PROBLEM), shown as the error
        self._events: dict[str, Stream] = {}
        self._logs: dict[str, Stream] = {}
        self.watched: list[str] = []  # stages whose logs are tailed (the selected one)
        self.telemetry = TelemetryModel()
        self.telemetry_stage: str | None = None
        self.listeners: list[Callable[[StageView, Event], None]] = []  # called with each applied event
        self.alerts = AlertFeed()  # RUN/alerts.jsonl: raised on the executing host, read by every front end

    # ------------------------------------------------------------------------------------------
    def watch_log(self, stage_id: str | None) -> None:
        """Tail this stage's log (the detail pane's stage); others are dropped to bound I/O."""
        self.watched = [stage_id] if stage_id else []

    @property
    def loaded(self) -> bool:
        return bool(self.order)

    @property
    def waiting_for(self) -> str:
        """What a console with no stages yet waits for, and why (a corrupt ``state.json`` says so)."""
        if self.state_problem:
            return self.state_problem  # it says it waits for the next snapshot
        return "waiting for the supervisor's first snapshot…"

    def families(self) -> list[tuple[str, list[StageView]]]:
        """Stages grouped by plan family, in plan order (the 10 preps read as one block)."""
        out: dict[str, list[StageView]] = {}
        for sid in self.order:
            st = self.stages[sid]
            out.setdefault(st.family, []).append(st)
        return list(out.items())

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for st in self.stages.values():
            c[st.state] = c.get(st.state, 0) + 1
        return c

    def all_succeeded(self) -> bool:
        return bool(self.stages) and all(
            s.state in (StageState.SUCCEEDED, StageState.SKIPPED) for s in self.stages.values()
        )

    # ------------------------------------------------------------------------------------------
    async def poll(self) -> set[str]:
        """Read what is new; returns the ids of stages that changed ("*" for the whole run)."""
        changed: set[str] = set()
        reqs: list[tuple[str, int]] = [("state.json", 0)]
        ev_ids = list(self.order)
        for sid in ev_ids:
            stream = self._events.setdefault(sid, Stream())
            reqs.append((stream.rel(f"stages/{sid}/events.jsonl"), stream.offset))
        log_ids = [s for s in self.watched if s in self.stages]
        for sid in log_ids:
            reqs.append((f"stages/{sid}/stage.log", self._logs.setdefault(sid, Stream()).offset))
        with_telemetry = self.telemetry_stage is not None  # fixed now: state.json below may change it
        if with_telemetry:
            reqs.append(self.telemetry.read_request())
        reqs.append(self.alerts.read_request())  # the run's alert records, last (console.alert_feed)
        try:
            results = await self.transport.read_many(reqs, max_bytes=READ_WINDOW)
            state: ReadResult | None = results[0]
            if state is not None and state.size > len(state.data):  # a big plan's state: read all of it
                state = await read_whole(self.transport, "state.json", state)
        except Exception as exc:  # a transport drop: keep what we have, say why
            self.error = f"cannot read the run: {exc}"
            return {"*"}
        if state is not None and state.size >= 0 and state.data != self._state_raw:
            self._state_raw = state.data
            changed |= self._apply_state(state.data)
        self.error = self.state_problem
        for i, sid in enumerate(ev_ids, start=1):
            if self._apply_events(sid, self._events[sid], results[i].data, results[i].size, results[i].ino):
                changed.add(sid)
        base = 1 + len(ev_ids)
        for j, sid in enumerate(log_ids):
            r = results[base + j]
            if self._apply_log(sid, self._logs[sid], r.data, r.size, r.ino):
                changed.add(sid)
        if with_telemetry:
            r = results[base + len(log_ids)]
            if self.telemetry.ingest(r.data, r.size, r.ino):
                changed.add("telemetry")
        r = results[-1]
        if self.alerts.ingest(r.data, r.size, r.ino):
            changed.add("alerts")
        # Streams for stages that just appeared in state.json start on the next poll.
        if self.backfill:
            changed |= await self._backfill_step()
        return changed

    async def _backfill_step(self) -> set[str]:
        """Read the next chunk of the head of one events file skipped on attach, for its metric history.

        Attaching starts near the end of each events file (cheap, whatever the run's age); the curves
        then fill in their past in the background, :data:`BACKFILL_CHUNK` bytes per poll, the
        selected stage first. Once a stage's head is read its history is rebuilt head first, then
        what was read live, so a curve on day three starts at step 0.
        """
        for sid, stream in self._events.items():
            if stream.skipped and sid not in self._backfill:
                self._backfill[sid] = _Backfill(end=stream.skipped)
        todo = [sid for sid, b in self._backfill.items() if not b.done and sid in self.stages]
        if not todo:
            return set()
        sid = next((s for s in self.watched if s in todo), todo[0])
        b = self._backfill[sid]
        try:
            res = (
                await self.transport.read_many(
                    [(f"stages/{sid}/events.jsonl", b.pos)], max_bytes=BACKFILL_CHUNK
                )
            )[0]
        except Exception:
            return set()
        if res.size < b.end:  # the file was replaced: the live stream starts over anyway
            b.done = True
            return set()
        data = res.data[: b.end - b.pos]
        lines, used, _notes = b.skip.take(data, BACKFILL_CHUNK)  # an over-long line: skipped, not waited on
        if b.pos + len(data) >= b.end:
            used = len(data)  # the last line before the tail may be cut: the tail skipped it too
        b.pos += used
        wanted = [ln for ln in lines if b'"metric"' in ln or b'"started"' in ln]
        events, _bad = parse_lines(wanted)
        st = self.stages[sid]
        for ev in events:
            if ev.type == "started" and isinstance(ev.get("attempt"), int):
                b.attempt = ev.get("attempt")
            elif ev.type == "metric":
                _add_metric(b.history, b.attempt or 1, ev)
        if b.pos >= b.end or not used:
            b.done = True
            b.history.merge_after(st.history)
            st.history = b.history
            return {sid}
        return set()

    def _apply_state(self, raw: bytes) -> set[str]:
        try:
            snap = json.loads(raw)
            if not isinstance(snap, dict) or not isinstance(snap.get("stages", []), list):
                raise ValueError("not a state snapshot")
        except (
            ValueError
        ) as exc:  # never torn by the supervisor (atomic rename), but a disk, a copy or a hand can
            at = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
            doing = "showing the stages as last read" if self.order else "no stages to show yet"
            self.state_problem = STATE_PROBLEM.format(at=at, doing=doing)
            return {"*"}
        self.state_problem = None
        self.run_name = snap.get("run", self.run_name)
        self.executor = snap.get("executor", self.executor)
        sup = snap.get("supervisor") or {}
        self.supervisor_pid, self.supervisor_t = sup.get("pid"), sup.get("t")
        self.supervisor_alerts = [a for a in sup.get("alerts") or [] if isinstance(a, dict)]
        self.done = bool(snap.get("done"))
        changed = {"*"}
        order = []
        for d in snap.get("stages", []):
            sid = d["id"]
            order.append(sid)
            st = self.stages.get(sid)
            if st is None:
                st = self.stages[sid] = StageView(id=sid, family=d.get("family", sid))
            before = (
                st.state,
                st.display,
                st.queued,
                st.attempt,
                st.pid,
                st.reason,
                st.health,
                st.pausing,
                st.finished_at,
            )
            st.update_from(d)
            prog = d.get("progress")
            if prog and prog.get("t", 0) > st.progress.t:
                st.progress.add(prog["t"], prog.get("done") or 0, prog.get("total"), prog.get("unit") or "")
            if before != (
                st.state,
                st.display,
                st.queued,
                st.attempt,
                st.pid,
                st.reason,
                st.health,
                st.pausing,
                st.finished_at,
            ):
                changed.add(sid)
        self.order = order
        tel = find_telemetry_stage(snap.get("stages", []))
        if tel != self.telemetry_stage:
            self.telemetry_stage = tel
            self.telemetry.path = telemetry_path(tel or "telemetry")
        return changed

    def _apply_events(self, sid: str, stream: Stream, data: bytes, size: int, ino: int) -> bool:
        follow = follow_rotation(stream, data, size, ino, READ_WINDOW)
        lines, notes = (
            follow if follow is not None else consume(stream, data, size, ino, ATTACH_TAIL_BYTES, READ_WINDOW)
        )
        st = self.stages.get(sid)
        if not (lines or notes) or st is None:
            if stream.next_skip:
                stream.skip_carried, stream.next_skip = True, False
            return False
        events, _bad = parse_lines(lines)
        if stream.skip_carried:
            events = drop_carried(stream, events)
        if stream.next_skip:
            stream.skip_carried, stream.next_skip = True, False
        for note in notes:  # an over-long line skipped: a warning in the stage's events, not a frozen stage
            st.events.append(
                Event("message", time.time(), {"level": "warning", "code": "skipped-line", "text": note})
            )
        for ev in events:
            self._apply_event(st, ev)
        return bool(events or notes)

    def _apply_event(self, st: StageView, ev: Event) -> None:
        if ev.type == "progress":
            if ev.t >= st.progress.t:
                st.progress.add(ev.t, float(ev.get("done", 0)), ev.get("total"), ev.get("unit", ""))
            # Rows a prep rejected / requests a regeneration gave up on (the dataset panel's column).
            bad = ev.get("rejects", ev.get("failed"))
            if isinstance(bad, int | float) and not isinstance(bad, bool):
                st.rejects = int(bad)
        elif ev.type == "metric":
            name = str(ev.get("name"))
            st.metrics[name] = float(ev.get("value", 0.0))
            if name == "rejects":
                st.rejects = int(ev.get("value", 0))
            _add_metric(st.history, st.ev_attempt or st.attempt, ev)
        elif ev.type == "started":
            st.metrics.clear()
            st.progress = Progress()
            if isinstance(ev.get("attempt"), int):
                st.ev_attempt = ev.get("attempt")
        if ev.type != "progress":
            st.events.append(ev)
        for listener in self.listeners:
            listener(st, ev)

    def _apply_log(self, sid: str, stream: Stream, data: bytes, size: int, ino: int) -> bool:
        lines, notes = consume(stream, data, size, ino, LOG_TAIL_BYTES, READ_WINDOW)
        if not (lines or notes):
            return False
        st = self.stages[sid]
        new = [f"[aerie: {note}]" for note in notes] + [raw.decode(errors="replace") for raw in lines]
        st.log.extend(new)
        st.log_total += len(new)
        return True


@dataclass
class _Backfill:
    """Progress reading back the head of one events file for the curves."""

    end: int
    pos: int = 0
    attempt: int | None = None
    done: bool = False
    history: StageHistory = field(default_factory=StageHistory)
    skip: LineSkipper = field(default_factory=LineSkipper)


def _add_metric(history: StageHistory, attempt: int, ev: Event) -> None:
    """A metric event as a point of its series (``name`` or ``name/label``; finite values only)."""
    try:
        value = float(ev.get("value", 0.0))
    except (TypeError, ValueError):
        return
    if not math.isfinite(value):
        return
    name, label, step = str(ev.get("name")), ev.get("label"), ev.get("step")
    history.add(
        attempt,
        f"{name}/{label}" if isinstance(label, str) and label else name,
        value,
        step if isinstance(step, int | float) and not isinstance(step, bool) else None,
        ev.t,
    )


def describe_event(ev: Event) -> str:
    """One human line for an event (detail pane, headless output)."""
    d = ev.data
    if ev.type == "started":
        return f"started attempt {d.get('attempt')} (pid {d.get('pid')})"
    if ev.type == "finished":
        rc = d.get("returncode")
        return (
            f"finished: {d.get('status')}"
            + (f" (rc {rc})" if rc not in (None, 0) else "")
            + (f" {d['detail']}" if d.get("detail") else "")
            + (f": {d['error']}" if d.get("error") else "")
        )
    if ev.type == "metric":
        v = d.get("value")
        return f"{d.get('name')} = {v:.4g}" if isinstance(v, float) else f"{d.get('name')} = {v}"
    if ev.type == "message":
        lvl = d.get("level", "info")
        return (f"{lvl}: " if lvl != "info" else "") + str(d.get("text", ""))
    if ev.type == "health":
        return f"health: {d.get('state')}"
    if ev.type == "progress":
        return f"{d.get('done')}/{d.get('total')} {d.get('unit', '')}"
    return ev.to_json()
