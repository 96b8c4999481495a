"""The run's alerts, ``RUN/alerts.jsonl``: one typed record per episode, written on the executing host.

An alert is raised by the supervisor's watcher (:mod:`pipeline.run.alerts.watcher`) when one of the rules
(:mod:`pipeline.run.alerts.rules`) finds an episode, and every front end reads it from this file: each console
however late it attaches, the browser console, headless mode, ``aerie status`` and ``aerie watch``. The file is
append-only; each line is one operation on one record (``v`` is the format's version)::

    {"v": 1, "op": "raised", "id": 3, "key": "stalled:train:1:t1796…", "kind": "stalled", "stage": "train",
     "attempt": 1, "title": "…", "text": "…", "evidence": ["…"], "t": 1796….}
    {"v": 1, "op": "hook", "id": 3, "status": "started" | "done" | "timeout" | "silenced", "rc": 0,
     "t": 1796…., "duration_s": 0.02, "output": "…"}
    {"v": 1, "op": "cleared", "id": 3, "t": 1796….}
    {"v": 1, "op": "ack", "id": 3, "by": "ana@laptop", "t": 1796…., "silence": false}
    {"v": 1, "op": "snapshot", "record": {…}}        # a rotated file's head: a whole record

Folding the lines in order by ``id`` gives :class:`AlertRecord` s (:func:`fold`); a line seen twice folds the
same, so a reader never has to know where a rotation fell. ``id`` counts up from 1 in the order alerts were
raised (``aerie watch`` resumes after the last id it delivered); ``key`` names the episode by data every reader
sees alike (the step, the time it began), so a supervisor that restarts (SIGKILLed mid-episode) finds the
episode already recorded and raises it neither twice nor never.

Lines are appended with one ``write`` on an ``O_APPEND`` fd under an exclusive ``flock`` (the supervisor, the
hook runner and ``ctl ack`` write it), fsynced; 0600. Past its limit (:mod:`pipeline.run.rundir.growth`, kind
``alerts``) the appender renames it to ``alerts.1.jsonl`` and the new file starts with a ``snapshot`` of every
record still open or not yet acknowledged, so the current file alone always holds them. Stdlib only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.rundir import growth
from pipeline.run.rundir.files import append_line, fsync_dir

ALERTS_FILE = "alerts.jsonl"
VERSION = 1
OPS = ("raised", "hook", "cleared", "ack", "snapshot")
HEAD_MAX = 500  # records a rotated file's snapshot head carries at most (the open ones first)


@dataclass(frozen=True)
class Alert:
    """What a rule found: an episode proposed for recording (the watcher gives it an id)."""

    key: str  # <kind>:<stage>:<attempt>:<episode> — the episode, named by data every reader sees alike
    kind: str  # stage-failed | disk | stalled | loss-nonfinite | … | accept-gap (docs/operating.md)
    title: str
    text: str
    stage: str = ""
    attempt: int = 0
    evidence: tuple[str, ...] = ()  # the metric values / log lines / files that triggered it


@dataclass
class Delivery:
    """One hook run for one alert: where it stands, its exit code and when."""

    status: str  # started | done | timeout | silenced | failed (could not start)
    t: float
    rc: int | None = None
    duration_s: float | None = None
    output: str = ""
    command: str = ""


@dataclass
class AlertRecord:
    """One alert episode as every front end shows it."""

    id: int
    key: str
    kind: str
    stage: str
    attempt: int
    title: str
    text: str
    evidence: list[str]
    raised_at: float
    cleared_at: float | None = None
    hooks: list[Delivery] = field(default_factory=list)
    acked_by: str | None = None
    acked_at: float | None = None
    silenced: bool = False

    @property
    def open(self) -> bool:
        return self.cleared_at is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["open"] = self.open
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AlertRecord:
        rec = cls(
            id=int(d["id"]),
            key=str(d.get("key", "")),
            kind=str(d.get("kind", "")),
            stage=str(d.get("stage") or ""),
            attempt=int(d.get("attempt") or 0),
            title=str(d.get("title", "")),
            text=str(d.get("text", "")),
            evidence=[str(x) for x in d.get("evidence") or []],
            raised_at=float(d.get("raised_at") or d.get("t") or 0.0),
        )
        rec.cleared_at = _float(d.get("cleared_at"))
        rec.acked_by = d.get("acked_by") if isinstance(d.get("acked_by"), str) else None
        rec.acked_at = _float(d.get("acked_at"))
        rec.silenced = bool(d.get("silenced"))
        rec.hooks = [_delivery(h) for h in d.get("hooks") or [] if isinstance(h, dict)]
        return rec

    def delivered(self) -> bool:
        """Whether a hook run was started (or skipped, silenced) for it: a restarted supervisor runs none again."""
        return bool(self.hooks)


def _float(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _delivery(d: dict[str, Any]) -> Delivery:
    rc = d.get("rc")
    return Delivery(
        status=str(d.get("status", "")),
        t=float(d.get("t") or 0.0),
        rc=rc if isinstance(rc, int) and not isinstance(rc, bool) else None,
        duration_s=_float(d.get("duration_s")),
        output=str(d.get("output") or ""),
        command=str(d.get("command") or ""),
    )


# ---------------------------------------------------------------------------------------- lines
def raised_line(rec: AlertRecord) -> dict[str, Any]:
    return {
        "v": VERSION,
        "op": "raised",
        "id": rec.id,
        "key": rec.key,
        "kind": rec.kind,
        "stage": rec.stage,
        "attempt": rec.attempt,
        "title": rec.title,
        "text": rec.text,
        "evidence": rec.evidence,
        "t": round(rec.raised_at, 3),
    }


def hook_line(alert_id: int, d: Delivery) -> dict[str, Any]:
    out = {k: v for k, v in asdict(d).items() if v not in (None, "")}
    return {"v": VERSION, "op": "hook", "id": alert_id, **out}


def cleared_line(alert_id: int, t: float) -> dict[str, Any]:
    return {"v": VERSION, "op": "cleared", "id": alert_id, "t": round(t, 3)}


def ack_line(alert_id: int, by: str, t: float, silence: bool = False) -> dict[str, Any]:
    return {"v": VERSION, "op": "ack", "id": alert_id, "by": by, "t": round(t, 3), "silence": silence}


def apply(book: dict[int, AlertRecord], line: dict[str, Any]) -> None:
    """Fold one line into ``book`` (id -> record). Lines of unknown ops or for unknown ids are ignored."""
    op = line.get("op")
    if op == "snapshot" and isinstance(line.get("record"), dict):
        snap = AlertRecord.from_dict(line["record"])
        book[snap.id] = snap
        return
    raw_id = line.get("id")
    if not isinstance(raw_id, int) or isinstance(raw_id, bool):
        return
    if op == "raised":
        if raw_id not in book:
            book[raw_id] = AlertRecord.from_dict(line)
        return
    rec = book.get(raw_id)
    if rec is None:
        return
    t = _float(line.get("t")) or 0.0
    if op == "cleared" and rec.cleared_at is None:
        rec.cleared_at = t
    elif op == "hook":
        d = _delivery(line)
        # one entry per hook run: "started" is replaced by how it ended
        if rec.hooks and rec.hooks[-1].status == "started" and d.status != "started":
            rec.hooks[-1] = d
        elif d not in rec.hooks:
            rec.hooks.append(d)
    elif op == "ack":
        if rec.acked_at is None:
            rec.acked_by, rec.acked_at = str(line.get("by") or "?"), t
        rec.silenced = rec.silenced or bool(line.get("silence"))


def parse(data: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """The whole lines of ``data`` as dicts, and a note per line that is not a JSON object (a torn last line)."""
    out, bad = [], []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            bad.append(f"{ALERTS_FILE} line {n}: not JSON ({raw[:60]!r})")
            continue
        if isinstance(d, dict):
            out.append(d)
        else:
            bad.append(f"{ALERTS_FILE} line {n}: not an object")
    return out, bad


def fold(lines: list[dict[str, Any]]) -> dict[int, AlertRecord]:
    book: dict[int, AlertRecord] = {}
    for line in lines:
        apply(book, line)
    return book


def ordered(book: dict[int, AlertRecord]) -> list[AlertRecord]:
    """Open ones first (newest first), then the cleared ones (newest first): how every front end lists them."""
    return sorted(book.values(), key=lambda r: (not r.open, -r.id))


# ---------------------------------------------------------------------------------- the file
def path_of(run_root: Path | str) -> Path:
    return Path(run_root) / ALERTS_FILE


def read(run_root: Path | str) -> dict[int, AlertRecord]:
    """Every record the run's alert files hold (the kept generations, oldest first, then the current file)."""
    path = path_of(run_root)
    lines: list[dict[str, Any]] = []
    for p in [*reversed(growth.generations(path, growth.keep("alerts"))), path]:
        try:
            lines += parse(p.read_bytes())[0]
        except FileNotFoundError:
            continue
    return fold(lines)


def append(run_root: Path | str, lines: list[dict[str, Any]]) -> None:
    """Append ``lines`` in one ``write`` (fsynced) under the file's lock; rotate it past its limit, the new
    file starting with a snapshot of the records still open or unacknowledged."""
    append_if(run_root, lambda _book: lines, read_book=False)


def append_if(
    run_root: Path | str,
    decide: Callable[[dict[int, AlertRecord]], list[dict[str, Any]]],
    read_book: bool = True,
) -> None:
    """Under the file's lock: read every record (``read_book``), ask ``decide`` which lines to append, append
    them. What a check-then-write needs (:mod:`pipeline.run.alerts.deliver`: one delivery per alert)."""
    path = path_of(run_root)
    created = not path.exists()
    fd = growth.open_locked(path, os.O_RDWR | os.O_APPEND)  # 0600; nobody appends or rotates meanwhile
    try:
        lines = decide(read(run_root) if read_book else {})
        if not lines:
            return
        data = "".join(json.dumps(x, ensure_ascii=True) + "\n" for x in lines)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = "\n" + data  # a torn last line: ours starts on a line of its own
        append_line(fd, data.encode())
        os.fsync(fd)
        limit = growth.limit("alerts")
        if limit and os.fstat(fd).st_size >= limit:
            try:
                growth.rotate_file(path, growth.keep("alerts"), _head(run_root))
                created = True
            except OSError:
                pass  # written; the rotation is tried again by the next append
    finally:
        os.close(fd)
        if created:
            fsync_dir(path.parent)


def _head(run_root: Path | str) -> bytes:
    book = read(run_root)
    keep = [r for r in ordered(book) if r.open or r.acked_at is None][:HEAD_MAX]
    if book and max(book) not in {r.id for r in keep}:
        keep.append(book[max(book)])  # the newest id always: ids never count from 1 again
    keep.sort(key=lambda r: r.id)
    return "".join(
        json.dumps({"v": VERSION, "op": "snapshot", "record": asdict(r)}, ensure_ascii=True) + "\n"
        for r in keep
    ).encode()


def now() -> float:
    return round(time.time(), 3)


# ------------------------------------------------------------------------------- aerie status
STATUS_MAX = 200  # records ``ctl status`` sends at most (every open one, then the newest cleared ones)
ANOMALY_KINDS = (
    "stalled",
    "loss-nonfinite",
    "loss-diverging",
    "accept-falling",
    "gpu-idle",
    "server-throughput",
    "server-unhealthy",
    "forced-start",
    "accept-gap",
)


def status_section(run_root: Path | str) -> list[dict[str, Any]]:
    """``ctl status``'s ``alerts``: the records, open ones first, as dicts (``aerie status --json``)."""
    return [r.to_dict() for r in ordered(read(run_root))[:STATUS_MAX]]


def status_lines(records: list[AlertRecord], now: float) -> list[str]:
    """``aerie status``'s alerts: each open one with its evidence and hook deliveries, then the cleared ones."""
    opened = [r for r in records if r.open]
    if not records:
        return ["alerts: none"]
    out = [f"alerts: {len(opened)} open, {len(records) - len(opened)} cleared"]
    for r in records:
        when = time.strftime("%H:%M:%S", time.localtime(r.raised_at))
        state = (
            "open" if r.open else f"cleared {time.strftime('%H:%M:%S', time.localtime(r.cleared_at or now))}"
        )
        ack = f", acknowledged by {r.acked_by}" if r.acked_by else ""
        ack += " (silenced)" if r.silenced else ""
        out.append(f"  #{r.id:<4} {r.kind:<18} {r.stage or '-':<20} {when} {state}{ack}: {r.text}")
        if r.open:
            out += [f"        {line}" for line in r.evidence]
        for d in r.hooks:
            rc = "timeout" if d.status == "timeout" else f"rc {d.rc}" if d.rc is not None else d.status
            out.append(f"        hook: {rc} at {time.strftime('%H:%M:%S', time.localtime(d.t))}")
    return out
