"""The console's run model: what the widgets read, built from the run directory through a transport.

Each :meth:`RunModel.poll` asks the transport for what was appended since the last poll:
``state.json`` (the supervisor's snapshot of every stage), each stage's ``events.jsonl`` from its
byte offset, and the log tail of the stages being watched.

One route for each fact: a stage's row — its state, display state (queued, starting … a field, never read
from the reason's words) and progress — is the snapshot's (:class:`~pipeline.run.rundir.state_file.StateSnapshot`);
the events, decoded once into typed events (:mod:`pipeline.run.rundir.protocol`) and reduced
(:mod:`pipeline.run.rundir.stage_reducer`), give only what the snapshot does not carry: metrics and their
curves, the rate's samples, the event list.

Memory is bounded whatever the run's length: per stage the latest state, the latest value of each metric, each metric's history for the
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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from console.alert_feed import AlertFeed
from console.series import StageHistory
from console.streams import Stream, consume, drop_carried, follow_rotation
from console.telemetry_model import TelemetryModel, find_telemetry_stage, telemetry_path
from console.transport import ReadResult, Transport, read_whole
from pipeline.run.projection.compute import stall_decayed
from pipeline.run.rundir import protocol as proto
from pipeline.run.rundir.event_lines import LineSkipper
from pipeline.run.rundir.events import Event, parse_lines
from pipeline.run.rundir.protocol import RunEvent, decode, decode_all
from pipeline.run.rundir.stage_reducer import StageFacts
from pipeline.run.rundir.stage_row import TERMINAL, StageRow, StageState
from pipeline.run.rundir.state_file import StateSnapshot

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
    """A stage's progress: the fact (``done``/``total``/``unit`` as of ``t``) from ``state.json``'s row, and
    the samples the rate is measured over (a curve: the stage's progress events, and the row's report)."""

    done: float = 0.0
    total: float | None = None
    unit: str = ""
    t: float = 0.0
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def add(self, t: float, done: float, total: float | None, unit: str) -> None:
        """The row's report (the one route for the fact), and a sample."""
        self.done, self.total, self.unit, self.t = done, total, unit or self.unit, t
        self.sample(t, done)

    def sample(self, t: float, done: float) -> None:
        """One point of the rate's curve; an older one than the last is not (the window is in time order)."""
        if self.samples and done < self.samples[-1][1] and t >= self.samples[-1][0]:
            self.samples.clear()  # a new attempt restarted the count
        if self.samples and t == self.samples[-1][0]:
            self.samples[-1] = (t, done)  # the same instant reported twice: the later word
        elif not self.samples or t > self.samples[-1][0]:
            self.samples.append((t, done))

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    def rate(self, now: float | None = None) -> float | None:
        """Units per second over the recent window (None until two samples exist); with ``now``, decayed by
        a silence since the last sample (:func:`~pipeline.run.projection.compute.stall_decayed`)."""
        if len(self.samples) < 2:
            return None
        t1, d1 = self.samples[-1]
        horizon = t1 - RATE_WINDOW_S
        t0, d0 = next(((t, d) for t, d in self.samples if t >= horizon), self.samples[0])
        if t1 <= t0:
            return None
        rate = (d1 - d0) / (t1 - t0)
        return rate if now is None else stall_decayed(rate, t1 - t0, now - t1)

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at :meth:`rate` (decayed by a silence when ``now`` is given)."""
        r = self.rate(now)
        if not r or r <= 0 or self.total is None:
            return None
        return max(0.0, (self.total - self.done) / r)


@dataclass
class StageView(StageRow):
    """Everything the board and the detail pane show about one stage: its ``state.json`` row, and what
    the console keeps beside it (progress rates, metrics, log tail, history)."""

    progress: Progress = field(default_factory=Progress)
    metrics: dict[str, float] = field(default_factory=dict)  # the reducer's latest value per name (facts)
    events: deque[RunEvent] = field(default_factory=lambda: deque(maxlen=50))
    log: deque[str] = field(default_factory=lambda: deque(maxlen=1000))
    log_total: int = 0  # lines ever appended to ``log`` (it is bounded; this is not)
    rejects: int = 0
    history: StageHistory = field(default_factory=StageHistory)  # every metric over steps/time, bounded
    ev_attempt: int | None = None  # the attempt the events being read belong to (from `started`)
    # the events reduced (pipeline.run.rundir.stage_reducer): metrics, rejects
    facts: StageFacts = field(default_factory=StageFacts)

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
        self.from_files = False  # the rows are ``ctl status``'s from the stages' files (no snapshot yet)
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
        try:
            changed |= await self.alerts.load(self.transport)  # once, with its rotated generations
            reqs.append(self.alerts.read_request())  # the run's alert records, last (console.alert_feed)
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
        for ev in decode_all(events):
            match ev:
                case proto.Started(attempt=int()):
                    b.attempt = ev.attempt
                case proto.Metric():
                    _add_metric(b.history, b.attempt or 1, ev)
        if b.pos >= b.end or not used:
            b.done = True
            b.history.merge_after(st.history)
            st.history = b.history
            return {sid}
        return set()

    def show_rows_from_files(self, state: dict) -> set[str]:
        """``ctl status``'s rows from the stages' files (no snapshot, no supervisor: a read-only watcher)."""
        changed = self._apply_state(
            json.dumps({k: v for k, v in state.items() if k in ("run", "stages")}).encode()
        )
        self.from_files = True  # until the supervisor's first snapshot replaces them
        return changed

    def _apply_state(self, raw: bytes) -> set[str]:
        """The supervisor's snapshot (:class:`StateSnapshot`): each stage's row, taken as it is — its state,
        display state and progress come from here and nowhere else."""
        try:
            doc = json.loads(raw)
            snap = StateSnapshot.from_dict(doc)
        except (
            ValueError
        ) as exc:  # never torn by the supervisor (atomic rename), but a disk, a copy or a hand can
            at = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
            doing = "showing the stages as last read" if self.order else "no stages to show yet"
            self.state_problem = STATE_PROBLEM.format(at=at, doing=doing)
            return {"*"}
        self.state_problem = None
        self.from_files = False
        self.run_name = snap.run or self.run_name
        self.executor = snap.executor
        sup = snap.supervisor
        self.supervisor_pid, self.supervisor_t = sup.get("pid"), sup.get("t")
        self.supervisor_alerts = [a for a in sup.get("alerts") or [] if isinstance(a, dict)]
        self.done = snap.done
        changed = {"*"}
        order = []
        for r in snap.stages:
            sid = r.row.id
            order.append(sid)
            st = self.stages.get(sid)
            if st is None:
                st = self.stages[sid] = StageView(id=sid, family=r.row.family)
            before = _row_key(st)
            st.__dict__.update(r.row.__dict__)  # every row field (StageRow), as the snapshot has it
            _take_progress(st.progress, r.progress)
            if before != _row_key(st):
                changed.add(sid)
        self.order = order
        tel = find_telemetry_stage(doc["stages"] if isinstance(doc.get("stages"), list) else [])
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
            st.events.append(proto.Message(time.time(), note, "warning", proto.SKIPPED_LINE))
        for ev in events:
            self._apply_event(st, ev)
        return bool(events or notes)

    def _apply_event(self, st: StageView, wire: Event) -> None:
        """One event: the reducer's facts (metrics, rejects), the curves, the progress samples (the rate's
        curve) and the event list. A stage's state and progress are the snapshot's (:meth:`_apply_state`)."""
        ev = decode(wire)
        st.facts.apply(ev)
        st.metrics, st.rejects = st.facts.metrics, st.facts.bad
        match ev:
            case proto.Progress():
                st.progress.sample(ev.t, ev.done)
            case proto.Metric():
                _add_metric(st.history, st.ev_attempt or st.attempt, ev)
            case proto.Started():
                st.progress.samples.clear()
                if ev.attempt is not None:
                    st.ev_attempt = ev.attempt
        if not isinstance(ev, proto.Progress):
            st.events.append(ev)
        for listener in self.listeners:
            listener(st, wire)

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


def _row_key(st: StageView) -> tuple:
    return (
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


def _take_progress(progress: Progress, reported: dict | None) -> None:
    """The row's progress report into the view; none (a new attempt, not started): the view's starts over."""
    if not reported:
        if progress.t:
            progress.done, progress.total, progress.t = 0.0, None, 0.0
            progress.samples.clear()
        return
    t, done = reported.get("t"), reported.get("done")
    if not isinstance(t, int | float) or not isinstance(done, int | float):
        return
    total = reported.get("total")
    unit = reported.get("unit")
    progress.add(
        float(t),
        float(done),
        total if isinstance(total, int | float) else None,
        unit if isinstance(unit, str) else "",
    )


def _add_metric(history: StageHistory, attempt: int, ev: proto.Metric) -> None:
    """A metric event as a point of its series (``name`` or ``name/label``); a NaN or inf value is a
    point too, which the curves mark at its step."""
    history.add(attempt, ev.series, ev.value, ev.step, ev.t)
