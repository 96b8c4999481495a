"""What a new events generation starts with at rotation: carried copies of the stage's state.

When :class:`pipeline.run.rundir.events.EventWriter` rotates ``events.jsonl`` (:mod:`pipeline.run.rundir.growth`), the new
file starts with :func:`carry_lines`: the attempt's ``started`` event and the latest event per key
(progress per key, health, metric per name, coded messages, ``finished``), each marked ``"carried": true``,
so a reader that starts with the new file (a new supervisor, a console attaching) knows the state without
the old generations, and one that followed the old file to its end skips them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.rundir.event_lines import CARRIED, lines_from_end, quick_key

Obj = dict[str, Any]  # one event line as JSON (its "type" and "t" first, as the writer puts them)


def _carry_key(ev: Obj) -> tuple[str, ...] | None:
    """What a carried copy of ``ev`` stands for (the latest per key is carried); None: not carried."""
    kind = ev.get("type")
    if kind in ("health", "finished"):
        return (kind,)
    if kind == "progress":
        return ("progress", str(ev.get("key") or ""))
    if kind == "metric":
        return ("metric", str(ev.get("name")), str(ev.get("label") or ""))
    code = ev.get("code")
    if kind == "message" and isinstance(code, str) and code:
        return ("message", "pause" if code in ("paused", "resumed") else code)
    return None


@dataclass
class CarryScan:
    """What a scan of a generation found, back from byte ``upto`` of the file with inode ``ino``."""

    ino: int
    upto: int
    started: Obj | None = None
    latest: dict[tuple[str, ...], Obj] = field(default_factory=dict)  # newest first


def _scan(fh: Any, found: CarryScan, start: int) -> None:
    """Lines of ``fh`` from ``found.upto`` back to ``start`` (or to the latest ``started``) into ``found``."""
    seen: set[bytes] = set()
    for raw in lines_from_end(fh, start=start, end=found.upto):
        quick = quick_key(raw)
        if quick is None or quick in seen:
            continue
        try:
            ev = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(ev, dict) or not isinstance(ev.get("t"), int | float):
            continue
        if ev.get("type") == "started":
            found.started = ev
            return
        key = _carry_key(ev)
        if key is not None:
            seen.add(quick)
            found.latest.setdefault(key, ev)  # found last first: dict order is newest first


def carry_scan(path: Path) -> CarryScan:
    """The scan of the generation at ``path`` as it is now: done *before* a rotation takes its lock, so the
    other writers of the file append on while a big generation is read; :func:`carry_lines` then reads
    only what they appended meanwhile."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        found = CarryScan(st.st_ino, st.st_size)
        _scan(fh, found, 0)
    return found


def carry_lines(path: Path, before: CarryScan | None = None) -> bytes:
    """The lines a new generation starts with, from the generation at ``path`` being rotated: the latest
    ``started`` event and, after it, the latest event per :func:`_carry_key` in file order, each marked
    carried. ``before``: a :func:`carry_scan` of the same file taken earlier; only the bytes appended
    since are read.

    What a reader derives state from is never lost to rotation; what is carried is bounded by the
    number of progress keys, metric names and message codes, not by the run's length. The file is read
    from its end, decoding only a line whose key was not seen yet, back to the latest ``started``
    (what came before it was another attempt's): a 64 MiB generation costs a pass over its bytes, not
    a JSON decode of every line, and a line longer than any event (written past the event writer) is
    skipped unread (:func:`pipeline.run.rundir.event_lines.lines_from_end`): linear in the file's size.
    Lines are carried as written (only marked): readers validate them as they validate every line."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        usable = before is not None and before.ino == st.st_ino and before.upto <= st.st_size
        found = CarryScan(st.st_ino, st.st_size)
        _scan(fh, found, before.upto if usable and before is not None else 0)
    if usable and before is not None and found.started is None:
        found.started = before.started
        for key, ev in before.latest.items():
            found.latest.setdefault(key, ev)  # what was appended since is newer
    started = found.started
    out = ([started] if started else []) + list(reversed(found.latest.values()))  # in file order
    return "".join(
        json.dumps({**e, CARRIED: True}, separators=(",", ":"), ensure_ascii=False) + "\n" for e in out
    ).encode()
