"""The run watches itself: every alert rule, evaluated by the supervisor once per cycle from the run's own files,
whether or not any front end is attached.

:meth:`RunWatcher.tick` is the supervisor's one call per cycle (after it wrote ``state.json``). It reads only the
bytes appended since the last cycle — each running stage's ``events.jsonl`` (:class:`~pipeline.run.rundir.events.
EventTail`, offsets kept, rotation followed) and the telemetry agent's file — feeds them to the rules
(:mod:`pipeline.run.alerts.rules`, :mod:`pipeline.run.alerts.stage_rules`), looks at each running stage's clock,
then records what is new in ``RUN/alerts.jsonl`` (:mod:`pipeline.run.alerts.record`): a ``raised`` record per
episode not recorded before, a ``cleared`` line per episode that ended (re-arming its rule). Each raised record
is written *before* its hook is started, and the hook's deliverer is a child reaped without waiting
(:class:`~pipeline.run.alerts.hooks.HookSpawner`), so the loop never blocks on a hook.

Restart: a new supervisor (the old one SIGKILLed mid-episode) reads the record file first — the episodes already
raised, by key, and the records whose hook never started (those get their deliverer now) — then the last MiB of
each running stage's events, and on its first cycle proposes only the latest episode of each rule per stage; an
episode of a rule still open for the same stage and attempt is the same episode. So an episode is neither raised
twice nor lost, and a hook runs once (:mod:`pipeline.run.alerts.deliver`).

Cost: a ``stat`` per running stage and cycle, plus work per new event; stages that are not running cost nothing
(``bench/alerts_cost.py`` measures it; docs/performance.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.alerts import record, stage_rules
from pipeline.run.alerts.hooks import HookSpawner
from pipeline.run.alerts.record import Alert, AlertRecord
from pipeline.run.alerts.stage_rules import GpuSeen, StageWatch
from pipeline.run.plan.sections import AlertsSection
from pipeline.run.rundir import growth, protocol
from pipeline.run.rundir.events import EventTail
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.stage_row import StageRow, StageState

LIVE = (StageState.RUNNING, StageState.PAUSED)
QUIET = frozenset(StageState) - {*LIVE, StageState.FAILED}  # states in which only a stage's events speak
TELEMETRY_FILE = "telemetry.jsonl"
DISK_RANK = {"ok": 0, "warning": 1, "error": 2}
START_TAIL_BYTES = 1 << 20  # of a stage's events read when the watcher starts on it (a restart)
TELEMETRY_READ_MAX = 1 << 20  # bytes of the telemetry file read per cycle at most (the rest: next cycle)


@dataclass
class StageFeed:
    """One stage's events as the watcher reads them: where it is in the file, which attempt they belong to."""

    tail: EventTail
    watch: StageWatch
    ev_attempt: int | None = None  # the attempt of the events being read (from the latest ``Started``)
    live: bool = False  # read in the last cycle (a stage that stops running is read once more)


@dataclass
class TelemetryFeed:
    path: Path
    offset: int = 0
    gpus: dict[int, GpuSeen] = field(default_factory=dict)
    disk: tuple[str, str, float] = ("ok", "", 0.0)  # (level, words, sample time) of the latest disk record


class RunWatcher:
    def __init__(
        self,
        run: RunDir,
        rules: AlertsSection,
        log: Callable[[str], None],
        gpu_rules: bool = True,
        python: str | None = None,
    ) -> None:
        self.run, self.rules, self.log, self.gpu_rules = run, rules, log, gpu_rules
        self.hooks = (
            HookSpawner(str(run.root), rules.command, rules.timeout_s, *([python] if python else []))
            if rules.command
            else None
        )
        self.feeds: dict[str, StageFeed] = {}
        self.telemetry: TelemetryFeed | None = None
        self.first = True
        book = record.read(run.root)
        self.keys: dict[str, int] = {r.key: r.id for r in book.values()}
        self.open: dict[int, AlertRecord] = {r.id: r for r in book.values() if r.open}
        self.next_id = max(book, default=0) + 1
        self.undelivered = [r.id for r in sorted(book.values(), key=lambda r: r.id) if not r.delivered()]
        # when the previous supervisor last wrote its snapshot: a stage that finished after it finished while no
        # supervisor ran, and its last events (a bench stage's accept-gap) are read once on the first cycle
        self.resumed_from = _mtime(run.state_path)
        self.raised = 0  # alerts this watcher raised (tests and the benchmark read it)
        self.unwritten: list[dict[str, Any]] = []  # lines a failed append left, written first next cycle

    # ------------------------------------------------------------------------------------ cycle
    def tick(self, rows: dict[str, StageRow], now: float) -> None:
        """One supervisor cycle: read what is new, evaluate every rule, record and deliver."""
        found = self._telemetry(rows)  # first: the GPU rule of this cycle sees this cycle's samples
        if self.first:
            self._catch_up(rows)
        for sid, row in rows.items():
            if row.state in QUIET and not row.pausing and sid not in self.feeds:
                continue  # waiting or done, never followed: no stage rule reads it (10,000 held stages cost ~0)
            found += self._stage(sid, row, now)
        replay = self.first
        if replay:  # replayed history: the latest episode of each rule per stage only
            found = list({(a.stage, a.kind): a for a in found}.values())
            if self.hooks is not None:
                for alert_id in self.undelivered:
                    self.hooks.spawn(alert_id)
            self.undelivered = []
        self.first = False
        lines = self.unwritten + self._raise(found, now, replay) + self._clear(rows, now)
        if self.hooks is not None:
            self.hooks.reap()
        if not lines:
            return
        try:
            record.append(self.run.root, lines)
        except OSError:
            self.unwritten = lines  # a full or read-only disk: written at the next cycle, none lost
            raise  # the supervisor says so (an alert in state.json) and goes on
        self.unwritten = []
        for line in lines:  # a hook only for a record on disk
            if line["op"] == "raised" and self.hooks is not None:
                self.hooks.spawn(int(line["id"]))

    def close(self) -> None:
        """The supervisor exits: let running deliverers finish (bounded by the hook's timeout)."""
        if self.hooks is not None:
            self.hooks.drain(self.rules.timeout_s + 5)

    # ----------------------------------------------------------------------------------- stages
    def _catch_up(self, rows: dict[str, StageRow]) -> None:
        """A restart: the stages that ended while no supervisor ran are read once, as if seen ending. Only those
        (ended after the previous snapshot), so a restart of a 10,000-stage run reads a handful of files; a fresh
        run (no snapshot yet) has none ended."""
        since = self.resumed_from if self.resumed_from is not None else 0.0  # no snapshot: every ended stage
        for sid, row in rows.items():
            if row.state not in LIVE and row.finished_at is not None and row.finished_at >= since - 1.0:
                self._feed(sid, row).live = True

    def _feed(self, sid: str, row: StageRow) -> StageFeed:
        feed = self.feeds.get(sid)
        if feed is None:
            path = self.run.stage(sid).events
            feed = self.feeds[sid] = StageFeed(EventTail(path, _tail_start(path)), StageWatch(row.attempt))
        if feed.watch.attempt != row.attempt:
            feed.watch = StageWatch(row.attempt)
        return feed

    def _stage(self, sid: str, row: StageRow, now: float) -> list[Alert]:
        out: list[Alert] = []
        live = row.state in LIVE
        feed = self.feeds.get(sid)
        if live or (feed is not None and feed.live):  # running, or just stopped: read the rest once
            feed = self._feed(sid, row)
            feed.live = live
            out += self._read_events(sid, row, feed)
        fail = stage_rules.failed(row)
        if fail is not None:
            out.append(fail)
        if row.state == StageState.PAUSED or row.pausing:
            if feed is not None:
                feed.watch.was_paused = True
            return out
        if row.state != StageState.RUNNING or feed is None or row.run == "telemetry":
            return out
        sw = feed.watch
        if sw.was_paused:
            sw.was_paused, sw.resumed_at = False, now
        stall = stage_rules.stall(row, sw, self.rules, now, lambda: self._last_log(sid))
        if stall is not None:
            out.append(stall)
        if self.gpu_rules and self.telemetry is not None:
            idle = stage_rules.gpu_idle(row, sw, self.telemetry.gpus, self.rules)
            if idle is not None:
                out.append(idle)
        return out

    def _read_events(self, sid: str, row: StageRow, feed: StageFeed) -> list[Alert]:
        out: list[Alert] = []
        try:
            chunk = feed.tail.read()
        except OSError as exc:
            self.log(f"alerts: cannot read {sid}'s events: {exc}")
            return out
        for raw in chunk.events:
            ev = protocol.decode(raw)  # the run protocol: typed events, one decoder
            started = isinstance(ev, protocol.Started)
            if isinstance(ev, protocol.Started):
                feed.ev_attempt = ev.attempt
            if feed.ev_attempt is not None and feed.ev_attempt != row.attempt:
                continue  # an earlier attempt's events (none seen: a file whose head was rotated away)
            feed.watch.facts.apply(ev)  # the one reducer (pipeline.run.rundir.stage_reducer)
            if started:
                continue
            alert = stage_rules.on_event(feed.watch, ev, self.rules, sid, row.service)
            if alert is not None:
                out.append(alert)
        return out

    def _last_log(self, sid: str) -> str:
        try:
            tail = growth.read_tail(self.run.stage(sid).log, 4096)
        except OSError:
            return ""
        lines = [ln for ln in tail.decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    # -------------------------------------------------------------------------------- telemetry
    def _telemetry(self, rows: dict[str, StageRow]) -> list[Alert]:
        sid = next((s for s, r in rows.items() if r.run == "telemetry"), None)
        if sid is None:
            return []
        if self.telemetry is None:
            self.telemetry = TelemetryFeed(self.run.stage(sid).path / "out" / TELEMETRY_FILE)
        tel = self.telemetry
        for rec in self._read_telemetry(tel):
            kind = rec.get("kind")
            if kind == "gpu" and isinstance(rec.get("index"), int):
                tel.gpus.setdefault(rec["index"], GpuSeen()).apply(rec, self.rules.gpu_idle_util)
            elif kind == "disk":
                level = stage_rules.disk_level(rec)
                if level != tel.disk[0]:
                    tel.disk = (level, stage_rules.disk_words(rec), float(rec.get("t") or 0.0))
        level, words, t = tel.disk
        return [stage_rules.disk_alert(level, words, t)] if level != "ok" else []

    @staticmethod
    def _read_telemetry(tel: TelemetryFeed) -> Iterable[dict[str, Any]]:
        try:
            size = tel.path.stat().st_size
            if size < tel.offset:
                tel.offset = 0  # the agent started a new file (its own rotation)
            if size == tel.offset:
                return []
            with open(tel.path, "rb") as fh:
                fh.seek(tel.offset)
                buf = fh.read(min(TELEMETRY_READ_MAX, size - tel.offset))
        except OSError:
            return []
        end = buf.rfind(b"\n") + 1
        tel.offset += end
        out = []
        for line in buf[:end].splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict):
                out.append(d)
        return out

    # ---------------------------------------------------------------------------------- records
    def _raise(self, found: list[Alert], now: float, replay: bool) -> list[dict[str, Any]]:
        lines = []
        for a in found:
            if a.key in self.keys:
                continue
            same = self._same_open(a)
            if replay and same:
                continue  # the episode already recorded, seen younger in the events' tail
            for old in same:  # the rule fired again: the episode before ended (it re-armed in between)
                old.cleared_at = now
                del self.open[old.id]
                lines.append(record.cleared_line(old.id, now))
            if a.kind == "disk" and self._disk_open() >= DISK_RANK[_disk_level(a.key)]:
                continue  # the disk episode goes on at this level or a worse one
            rec = AlertRecord(
                self.next_id, a.key, a.kind, a.stage, a.attempt, a.title, a.text, list(a.evidence), now
            )
            self.next_id += 1
            self.keys[a.key] = rec.id
            self.open[rec.id] = rec
            self.raised += 1
            lines.append(record.raised_line(rec))
            self.log(f"alert {rec.id} raised: {rec.kind} {rec.stage or ''}: {rec.text}")
        return lines

    def _clear(self, rows: dict[str, StageRow], now: float) -> list[dict[str, Any]]:
        lines = []
        for rid, rec in list(self.open.items()):
            if not self._still_on(rec, rows):
                rec.cleared_at = now
                del self.open[rid]
                lines.append(record.cleared_line(rid, now))
        return lines

    def _still_on(self, rec: AlertRecord, rows: dict[str, StageRow]) -> bool:
        if rec.kind == "disk":
            level = self.telemetry.disk[0] if self.telemetry else "ok"
            return level != "ok" and DISK_RANK[level] >= DISK_RANK[_disk_level(rec.key)]
        row = rows.get(rec.stage)
        if row is None or row.attempt != rec.attempt:
            return False
        if rec.kind == "stage-failed":
            return row.state == StageState.FAILED
        feed = self.feeds.get(rec.stage)
        if not stage_rules.still_on(feed.watch if feed else None, rec.kind, row):
            return (
                False  # (no feed: a restart on an ended stage; only what its events alone decide stays open)
            )
        if rec.kind == "stalled":
            return feed is not None and feed.watch.stall_key == rec.key
        if rec.kind == "gpu-idle":
            return feed is not None and feed.watch.idle_key == rec.key
        return True

    def _same_open(self, a: Alert) -> list[AlertRecord]:
        """The open records of the same rule, stage and attempt (the disk has its own levels)."""
        if a.kind == "disk":
            return []
        return [r for r in self.open.values() if (r.kind, r.stage, r.attempt) == (a.kind, a.stage, a.attempt)]

    def _disk_open(self) -> int:
        return max((DISK_RANK[_disk_level(r.key)] for r in self.open.values() if r.kind == "disk"), default=0)


def _tail_start(path: Path) -> int:
    """Where a watcher starting on a stage reads its events from: the last :data:`START_TAIL_BYTES` (whole
    lines: the first, cut, is skipped), so a restarted supervisor on a week-old run reads a few MiB, not the
    stage's whole history, and its first cycles stay short. The rules' windows (50 losses, 30 samples) and
    clocks need far less."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0
    if size <= START_TAIL_BYTES:
        return 0
    with open(path, "rb") as fh:
        fh.seek(size - START_TAIL_BYTES)
        skip = fh.readline()  # the cut line
    return size - START_TAIL_BYTES + len(skip)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _disk_level(key: str) -> str:
    """``disk:warning:t…`` -> ``warning``."""
    level = key.split(":")[1] if key.count(":") >= 1 else "ok"
    return level if level in DISK_RANK else "ok"


def for_plan(
    run: RunDir, alerts: AlertsSection, executor_kind: str, log: Callable[[str], None]
) -> RunWatcher:
    """The supervisor's watcher for a run (GPU-idle only where the telemetry samples the stages' own GPUs: the
    supervisor's own host, local or over SSH; a Slurm job's GPUs are on its nodes)."""
    return RunWatcher(run, alerts, log, gpu_rules=executor_kind != "slurm")
