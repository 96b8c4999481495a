"""The event protocol: the one definition of what stages write to ``events.jsonl``.

Every stage (built-in or operator command, through the launcher) and every reader (supervisor,
console, ``aerie status``) goes through this module, so the wire format lives in one place.

One event is one JSON object on one line, appended with a single ``write`` to a file opened with
``O_APPEND`` so that concurrent writers (the launcher and its stage) never interleave bytes.

Event types:

* ``started``   ``{attempt, pid}``                      written by the launcher
* ``progress``  ``{done, total, unit, key?}``           ``key`` names a sub-task (e.g. a dataset)
* ``metric``    ``{name, value, step?}``
* ``message``   ``{level, text}``                       level: info | warning | error
* ``health``    ``{state}``                             services: starting | ready | unhealthy
* ``finished``  ``{status, returncode?, detail?, error?}``    written by the launcher

Readers use :class:`EventTail`, which reads from a byte offset and only ever returns complete
lines, so an event is never seen half-written, never lost and never seen twice.

Bounds (``docs/data-formats.md``, ``docs/reliability.md``), so one bad line never freezes a reader:

* a serialized event is at most :data:`MAX_EVENT_BYTES`: :class:`EventWriter` cuts longer string fields
  with a visible marker (``… [truncated N bytes]``) and sets ``"truncated": <original size>`` — still
  valid JSON, still the same event type (:func:`bound`);
* a line longer than a reader's window (written by something that bypassed the writer) is skipped,
  reading forward to its newline in chunks, and reported as a bad line (:class:`LineSkipper`);
* a writer that opens a file whose last byte is not ``\n`` (a writer killed mid-line) first ends that
  torn line, so its fragment stays one bad line and never swallows the next event (:func:`end_torn_line`);
  a reader also salvages an event that follows garbage on one line (:func:`salvage`).

Rotation (:mod:`pipeline.run.rundir.growth`): past its limit (64 MiB) the writer renames the file to
``events.1.jsonl`` (older ones shift to ``.2``, ``.3``; the oldest is dropped) and the new file starts
with *carried* lines (:func:`carry_lines`): copies, marked ``"carried": true``, of what a reader needs
to know the stage's state without the old generations — the attempt's ``started`` event, the latest
progress per key, health, metric per name, paused/resumed and other coded messages, ``finished``. A
reader that followed the old generation to its end skips them (it has seen the originals); one that
starts with the new file (a new supervisor, a console attaching) applies them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.rundir import growth
from pipeline.run.rundir.event_carry import carry_lines
from pipeline.run.rundir.event_lines import (
    _SHOWN_BYTES,
    CARRIED,
    MAX_EVENT_BYTES,
    SKIP_CHUNKS,
    LineSkipper,
    end_torn_line,
    shown,
)
from pipeline.run.rundir.files import private_dir
from pipeline.run.rundir.stage_row import HealthState

EVENT_TYPES = ("started", "progress", "metric", "message", "health", "finished")
LEVELS = ("info", "warning", "error")
HEALTH_STATES = tuple(HealthState)


class EventError(ValueError):
    """An event line that does not follow the protocol."""


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded event. ``data`` holds the type-specific fields."""

    type: str
    t: float
    data: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_json(self) -> str:
        obj = {"type": self.type, "t": round(self.t, 3), **self.data}
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def make(type_: str, t: float | None = None, **data: Any) -> Event:
    """Build an event, checking its type and required fields."""
    if type_ not in EVENT_TYPES:
        raise EventError(f"unknown event type {type_!r}")
    ev = Event(type_, time.time() if t is None else t, {k: v for k, v in data.items() if v is not None})
    validate(ev)
    return ev


def validate(ev: Event) -> None:
    d = ev.data
    if ev.type == "progress":
        if not isinstance(d.get("done"), int | float):
            raise EventError("progress event needs a numeric 'done'")
        if d.get("total") is not None and not isinstance(d["total"], int | float):
            raise EventError("progress 'total' must be a number or absent")
    elif ev.type == "metric":
        if not isinstance(d.get("name"), str) or not isinstance(d.get("value"), int | float):
            raise EventError("metric event needs a string 'name' and a numeric 'value'")
    elif ev.type == "message":
        if d.get("level", "info") not in LEVELS or not isinstance(d.get("text"), str):
            raise EventError("message event needs 'text' and a level in " + "/".join(LEVELS))
    elif ev.type == "health":
        if d.get("state") not in HEALTH_STATES:
            raise EventError("health event needs a state in " + "/".join(HEALTH_STATES))
    elif ev.type == "finished" and not isinstance(d.get("status"), str):
        raise EventError("finished event needs a 'status'")


def decode(line: str | bytes) -> Event:
    """Decode one line; raises :class:`EventError` for anything malformed. A kind not in :data:`EVENT_TYPES`
    (a newer writer's) is returned as it is; :mod:`pipeline.run.rundir.protocol` types each line."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventError("event is not an object")
    type_ = obj.pop("type", None)
    t = obj.pop("t", None)
    # a kind this version does not know is kept (pipeline.run.rundir.protocol.Unknown), never dropped
    if not isinstance(type_, str) or not type_ or not isinstance(t, int | float):
        raise EventError(f"bad event type/time: {type_!r}")
    ev = Event(type_, float(t), obj)
    validate(ev)
    return ev


class EventWriter:
    """Appends events to one ``events.jsonl`` (one ``write`` per event, ``O_APPEND``)."""

    def __init__(self, path: Path, rotate_bytes: int | None = None) -> None:
        self.path = Path(path)
        private_dir(self.path.parent)
        # 0600; follows and performs rotation (growth.SharedAppender, carry_lines); a torn last line is
        # ended first (end_torn_line), so its fragment never swallows the next event
        self._out = growth.SharedAppender(
            self.path, "events", head=carry_lines, limit_bytes=rotate_bytes, on_open=end_torn_line
        )

    def write(self, ev: Event) -> None:
        """Append one whole line, or nothing: a full disk must never leave a torn line behind.

        An event over :data:`MAX_EVENT_BYTES` is cut first (:func:`bound`). A write that fails part-way
        (``ENOSPC`` after some bytes reached the file) is rolled back with ``ftruncate`` to where the line
        started, then the error is raised."""
        raw = ev.to_json().encode()
        if len(raw) > MAX_EVENT_BYTES:
            raw = bound(ev).to_json().encode()
        self._out.append(raw + b"\n")

    def emit(self, type_: str, **data: Any) -> Event:
        ev = make(type_, **data)
        self.write(ev)
        return ev

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Chunk:
    """What one read of a tail produced: decoded events and lines that were not events."""

    events: list[Event]
    bad_lines: list[str]
    offset: int


def parse_lines(lines: list[bytes]) -> tuple[list[Event], list[str]]:
    """Decode complete lines: the events, and the lines that were not events (shortened for display).

    A line that is not an event but ends with one (a torn fragment a writer appended onto) yields that
    event too (:func:`salvage`)."""
    events: list[Event] = []
    bad: list[str] = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            events.append(decode(raw))
        except EventError:
            ev = salvage(raw)
            if ev is not None:
                events.append(ev)
            bad.append(shown(raw))
    return events, bad


class EventTail:
    """Incremental reader of a local ``events.jsonl`` from a byte offset.

    ``read()`` returns only what was appended since the last call, and only whole lines. When the file
    was rotated (its inode changed) it finishes the old generation (found by inode among
    ``events.N.jsonl``) and goes on with the newer ones, skipping their carried lines: nothing is lost
    or repeated. If the old generation is gone (dropped, or the file was replaced) it reads the current
    file from its start, carried lines included, so its state is whole again; a file that shrank in
    place is read again from its start.
    """

    def __init__(self, path: Path, offset: int = 0, max_bytes: int = 4 << 20) -> None:
        self.path = Path(path)
        self.offset = offset
        self.max_bytes = max_bytes
        self._ino: int | None = None
        self._skip = LineSkipper()  # a line longer than max_bytes: skipped to its newline, reported
        self._skip_carried = False  # we came from an older generation: its carried copies were seen
        self._mark = b""  # the last bytes read: a rotated generation found by inode must end them there

    def read(self) -> Chunk:
        out = Chunk([], [], self.offset)
        for _ in range(growth.keep("events") + 2):  # at most every generation once per call
            where = self._locate()
            if where is None:
                break
            src, size, rotated = where
            chunk, exhausted = self._read_from(src, size)
            out.events.extend(chunk.events)
            out.bad_lines.extend(chunk.bad_lines)
            if not (rotated and exhausted):
                break
            self._next_generation()
        out.offset = self.offset
        return out

    def _read_from(self, src: Path, size: int) -> tuple[Chunk, bool]:
        """Whole lines of ``src`` from our offset; and whether its end was reached."""
        if size <= self.offset:
            return Chunk([], [], self.offset), True
        with open(src, "rb") as fh:
            if self._ino is not None and os.fstat(fh.fileno()).st_ino != self._ino:
                return Chunk([], [], self.offset), False  # rotated again since we looked: next call
            if not self._ends_mark(fh.fileno()):
                # a new file that got our old file's inode number (ours was rotated away and dropped)
                self.offset, self._skip_carried, self._mark, self._skip = 0, False, b"", LineSkipper()
            lines: list[bytes] = []
            notes: list[str] = []
            for _ in range(SKIP_CHUNKS):  # an over-long line: read forward to its newline, a window a step
                fh.seek(self.offset)
                buf = fh.read(min(self.max_bytes, size - self.offset))
                got, used, skipped = self._skip.take(buf, self.max_bytes)
                self.offset += used
                if used:
                    self._mark = buf[max(0, used - 64) : used]
                lines += got
                notes += skipped
                if got or not self._skip.skipping or self.offset >= size:
                    break
        events, bad = parse_lines(lines)
        if self._skip_carried:
            events, self._skip_carried = drop_carried_head(events)
        return Chunk(events, notes + bad, self.offset), self.offset + (len(buf) - used) >= size

    # -- rotation -------------------------------------------------------------------------------
    def _locate(self) -> tuple[Path, int, bool] | None:
        """Which file to read now: (path, its size, whether it is a rotated generation)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            st = None
        if self._ino is None or (st is not None and st.st_ino == self._ino):
            if st is None:
                return None
            if st.st_size < self.offset:  # cut in place: read it again
                self.offset, self._skip_carried, self._mark, self._skip = 0, False, b"", LineSkipper()
            self._ino = st.st_ino
            return self.path, st.st_size, False
        found = growth.find_generation(self.path, self._ino, growth.keep("events"))
        if found is not None and self._ends_mark(found[1]):
            return found[1], found[2].st_size, True
        if st is None:
            return None
        # our generation is gone: the current file from its start (its carried lines give the state)
        self._ino, self.offset, self._skip_carried, self._mark, self._skip = (
            st.st_ino,
            0,
            False,
            b"",
            LineSkipper(),
        )
        return self.path, st.st_size, False

    def _ends_mark(self, where: Path | int) -> bool:
        """Is ``where`` (a path or an open fd) the file we read, not one that reused its inode number
        after ours was rotated away and dropped? Its bytes before our offset are the last ones we read."""
        if not self._mark or self.offset < len(self._mark):
            return True
        try:
            if isinstance(where, int):
                return os.pread(where, len(self._mark), self.offset - len(self._mark)) == self._mark
            with open(where, "rb") as fh:
                return os.pread(fh.fileno(), len(self._mark), self.offset - len(self._mark)) == self._mark
        except OSError:
            return False

    def _next_generation(self) -> None:
        """Done with a rotated generation: on to the next newer one, after its carried lines."""
        assert self._ino is not None
        found = growth.find_generation(self.path, self._ino, growth.keep("events"))
        n = found[0] if found else 1
        try:
            self._ino = growth.generation(self.path, n - 1).stat().st_ino
        except FileNotFoundError:
            self._ino = None
        self.offset, self._skip_carried, self._mark, self._skip = 0, True, b"", LineSkipper()


def drop_carried_head(events: list[Event]) -> tuple[list[Event], bool]:
    """The events of a new generation read from its start, less its carried head (copies of what the reader
    saw in the generation before); and whether the head may still go on in the next read (every event here
    was carried). Carried lines stand only at a generation's head (:func:`pipeline.run.rundir.event_carry.carry_lines`)."""
    n = 0
    while n < len(events) and events[n].get(CARRIED):
        n += 1
    return events[n:], n == len(events)


def read_all(path: Path) -> list[Event]:
    """Every event in a file (tests and small tools; the console uses :class:`EventTail`)."""
    tail = EventTail(path, max_bytes=1 << 62)
    return tail.read().events


# -- bounds: event size, over-long lines, torn lines ------------------------------------------------
_REQUIRED = {"done", "total", "name", "value", "level", "text", "state", "status", "attempt", "pid"}


def truncation_marker(n: int) -> str:
    """What replaces the end of a string field cut by :func:`bound`."""
    return f"… [truncated {n:,} bytes]"


def _json_len(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def _string_leaves(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    if isinstance(obj, str):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _string_leaves(v, (*path, k))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in _string_leaves(v, (*path, i))]
    return []


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def bound(ev: Event, limit: int = MAX_EVENT_BYTES) -> Event:
    """``ev`` if its line fits in ``limit`` bytes, else a copy whose longest string fields (nested ones too)
    end in :func:`truncation_marker` and which carries ``"truncated": <original line size>``. Fields other
    than the ones its type needs are replaced by a marker if cutting strings is not enough. Still valid
    JSON, still the same type, still passing :func:`validate`."""
    size = len(ev.to_json().encode())
    if size <= limit:
        return ev
    original: dict[str, Any] = json.loads(ev.to_json())
    del original["type"], original["t"]
    data = json.loads(json.dumps(original))
    data["truncated"] = size
    overhead = _json_len({"type": ev.type, "t": round(ev.t, 3)})
    # Every long string field is cut to one common length, the largest that fits (a binary search).
    leaves = [(p, v.encode()) for p, v in _string_leaves(data) if len(v) > _SHOWN_BYTES]

    def size_at(cap: int) -> int:
        for path, raw in leaves:
            cut = raw[:cap].decode(errors="ignore")
            _set(
                data,
                path,
                cut + truncation_marker(len(raw) - len(cut.encode())) if len(raw) > cap else raw.decode(),
            )
        return overhead + _json_len(data)

    # Still too big with every long string cut to nothing (e.g. a huge list of numbers): replace optional
    # fields by a marker, the largest first.
    dropped: set[str] = set()
    while size_at(0) > limit:
        optional = [k for k in data if k not in _REQUIRED and k != "truncated" and k not in dropped]
        if not optional:
            break
        k = max(optional, key=lambda key: _json_len(data[key]))
        data[k] = f"[dropped: {_json_len(original[k]):,} bytes]"
        dropped.add(k)
        leaves = [(p, raw) for p, raw in leaves if p[0] != k]
    lo, hi = 0, max((len(raw) for _, raw in leaves), default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size_at(mid) <= limit else (lo, mid - 1)
    size_at(lo)
    out = Event(ev.type, ev.t, data)
    validate(out)
    return out


_EVENT_START = b'{"type":"'


def salvage(raw: bytes) -> Event | None:
    """The event at the end of a line that is not one (``<torn fragment>{"type":"progress",…}``), if any:
    cheap, it tries only the last place an event written by :class:`EventWriter` can start."""
    at = raw.rfind(_EVENT_START)
    if at <= 0:
        return None
    try:
        return decode(raw[at:])
    except EventError:
        return None
