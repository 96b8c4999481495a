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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.files import append_line

EVENT_TYPES = ("started", "progress", "metric", "message", "health", "finished")
LEVELS = ("info", "warning", "error")
HEALTH_STATES = ("starting", "ready", "unhealthy", "stopped")


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
    """Decode one line; raises :class:`EventError` for anything malformed."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventError("event is not an object")
    type_ = obj.pop("type", None)
    t = obj.pop("t", None)
    if type_ not in EVENT_TYPES or not isinstance(t, int | float):
        raise EventError(f"bad event type/time: {type_!r}")
    ev = Event(type_, float(t), obj)
    validate(ev)
    return ev


class EventWriter:
    """Appends events to one ``events.jsonl`` (one ``write`` per event, ``O_APPEND``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, ev: Event) -> None:
        """Append one whole line, or nothing: a full disk must never leave a torn line behind.

        A write that fails part-way (``ENOSPC`` after some bytes reached the file) is rolled back with
        ``ftruncate`` to where the line started, then the error is raised."""
        append_line(self._fd, (ev.to_json() + "\n").encode())

    def emit(self, type_: str, **data: Any) -> Event:
        ev = make(type_, **data)
        self.write(ev)
        return ev

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

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


def split_complete(buf: bytes) -> tuple[list[bytes], int]:
    """Split ``buf`` into complete lines; return them and how many bytes they used."""
    end = buf.rfind(b"\n")
    if end < 0:
        return [], 0
    return buf[: end + 1].splitlines(), end + 1


def parse_lines(lines: list[bytes]) -> tuple[list[Event], list[str]]:
    events: list[Event] = []
    bad: list[str] = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            events.append(decode(raw))
        except EventError:
            bad.append(raw.decode(errors="replace"))
    return events, bad


class EventTail:
    """Incremental reader of a local ``events.jsonl`` from a byte offset.

    ``read()`` returns only what was appended since the last call, and only whole lines. If the
    file shrinks or is replaced (a ``--fresh`` retry), it restarts from the beginning.
    """

    def __init__(self, path: Path, offset: int = 0, max_bytes: int = 4 << 20) -> None:
        self.path = Path(path)
        self.offset = offset
        self.max_bytes = max_bytes
        self._ino: int | None = None

    def read(self) -> Chunk:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return Chunk([], [], self.offset)
        if (self._ino is not None and st.st_ino != self._ino) or st.st_size < self.offset:
            self.offset = 0
        self._ino = st.st_ino
        if st.st_size == self.offset:
            return Chunk([], [], self.offset)
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            buf = fh.read(min(self.max_bytes, st.st_size - self.offset))
        lines, used = split_complete(buf)
        self.offset += used
        events, bad = parse_lines(lines)
        return Chunk(events, bad, self.offset)


def read_all(path: Path) -> list[Event]:
    """Every event in a file (tests and small tools; the console uses :class:`EventTail`)."""
    tail = EventTail(path, max_bytes=1 << 62)
    return tail.read().events
