"""What a new events generation starts with at rotation: carried copies of the stage's state.

When :class:`pipeline.run.rundir.events.EventWriter` rotates ``events.jsonl`` (:mod:`pipeline.run.rundir.growth`), the new
file starts with :func:`carry_lines`: the attempt's ``started`` event and the latest event per key
(progress per key, health, metric per name, coded messages, ``finished``), each marked ``"carried": true``,
so a reader that starts with the new file (a new supervisor, a console attaching) knows the state without
the old generations, and one that followed the old file to its end skips them.
"""

from __future__ import annotations

import json
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


def carry_lines(path: Path) -> bytes:
    """The lines a new generation starts with, from the generation at ``path`` being rotated: the latest
    ``started`` event and, after it, the latest event per :func:`_carry_key` in file order, each marked
    carried.

    What a reader derives state from is never lost to rotation; what is carried is bounded by the
    number of progress keys, metric names and message codes, not by the run's length. The file is read
    from its end, decoding only a line whose key was not seen yet, back to the latest ``started``
    (what came before it was another attempt's): a 64 MiB generation costs a pass over its bytes, not
    a JSON decode of every line. Lines are carried as written (only marked): readers validate them as
    they validate every line."""
    started: Obj | None = None
    latest: dict[tuple[str, ...], Obj] = {}
    seen: set[bytes] = set()
    with open(path, "rb") as fh:
        for raw in lines_from_end(fh):
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
                started = ev
                break
            key = _carry_key(ev)
            if key is not None:
                seen.add(quick)
                latest.setdefault(key, ev)  # found last first: dict order is newest first
    out = ([started] if started else []) + list(reversed(latest.values()))  # in file order
    return "".join(
        json.dumps({**e, CARRIED: True}, separators=(",", ":"), ensure_ascii=False) + "\n" for e in out
    ).encode()
