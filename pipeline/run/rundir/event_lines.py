"""Event files at the byte level: whole lines, over-long lines, torn lines, and what a line is about.

:mod:`pipeline.run.rundir.events` is the protocol (what an event is, how it is written and read); this module is
what its writer and readers do with raw bytes before any JSON is decoded, so it needs no event type:
:func:`split_complete` (only whole lines), :class:`LineSkipper` (a line longer than a reader's window is
skipped forward to its newline, reported, never waited on), :func:`end_torn_line` (a writer killed
mid-line never gets the next event glued onto its fragment), :func:`lines_from_end` and
:func:`quick_key` (rotation's carried lines found from a file's end without decoding every line).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.run.rundir.files import append_line

CARRIED = (
    "carried"  # marks a copy carried into a new generation at rotation (pipeline.run.rundir.event_carry)
)

MAX_EVENT_BYTES = 64 << 10  # a serialized event, newline excluded (EventWriter cuts longer string fields)


def split_complete(buf: bytes) -> tuple[list[bytes], int]:
    """Split ``buf`` into complete lines; return them and how many bytes they used."""
    end = buf.rfind(b"\n")
    if end < 0:
        return [], 0
    return buf[: end + 1].splitlines(), end + 1


_TYPE_RE = re.compile(rb'"type":"(\w+)"')


_FIELD_RE = {
    f: re.compile(rb'"' + f + rb'":"((?:[^"\\]|\\.)*)"') for f in (b"key", b"name", b"label", b"code")
}


_QUICK_FIELDS = {b"progress": (b"key",), b"metric": (b"name", b"label"), b"message": (b"code",)}


def quick_key(raw: bytes) -> bytes | None:
    """A line's :func:`pipeline.run.rundir.events._carry_key` from its bytes, without decoding it (None: never carried)."""
    m = _TYPE_RE.search(raw)
    if m is None:
        return b"?" + raw  # not the usual layout: decoded to find out
    kind = m.group(1)
    if kind in (b"started", b"health", b"finished"):
        return kind
    fields = _QUICK_FIELDS.get(kind)
    if fields is None:
        return None
    parts = [kind]
    for f in fields:
        fm = _FIELD_RE[f].search(raw)
        parts.append(fm.group(1) if fm else b"")
    if kind == b"message":
        if not parts[1]:
            return None  # an uncoded message is not carried
        if parts[1] in (b"paused", b"resumed"):
            parts[1] = b"pause"
    return b"\0".join(parts)


LONGEST_SCANNED = 2 * MAX_EVENT_BYTES  # a line longer than this, read from the end, is skipped unread


def lines_from_end(
    fh: Any, block: int = 1 << 20, start: int = 0, longest: int = LONGEST_SCANNED, end: int | None = None
) -> Iterator[bytes]:
    """The complete lines of a file from its end back to byte ``start``, last first (a torn last line is
    skipped). A line longer than ``longest`` (written by something that bypassed the event writer) is
    skipped without being gathered: each byte is read once, so a file holding a 100 MiB line costs one
    pass, not a copy of the line per block. ``end``: where to start reading back (default: the file's size)."""
    end = os.fstat(fh.fileno()).st_size if end is None else end
    rest = b""
    overlong = False  # inside a line to drop (over-long, or torn at the end): dropped up to its start
    first = True
    while end > start:
        lo = max(start, end - block)
        fh.seek(lo)
        buf = fh.read(end - lo)
        end = lo
        if first:
            first, overlong = False, not buf.endswith(b"\n")  # a torn last line is not an event
        if overlong:
            nl = buf.rfind(b"\n")
            if nl < 0:
                continue  # still inside it
            buf, overlong = buf[: nl + 1], False
        else:
            buf += rest
        lines = buf.split(b"\n")
        rest = lines.pop(0) if lo > start else b""
        yield from (ln for ln in reversed(lines) if ln.strip() and len(ln) <= longest)
        if len(rest) > longest:
            rest, overlong = b"", True
    if rest.strip() and not overlong:
        yield rest


SKIP_CHUNKS = 16  # windows an EventTail reads forward in one call while skipping an over-long line


_SHOWN_BYTES = 300  # of a bad line, what a warning quotes


def shown(raw: bytes) -> str:
    text = raw[:_SHOWN_BYTES].decode(errors="replace")
    return text if len(raw) <= _SHOWN_BYTES else f"{text}… [{len(raw):,} bytes]"


def end_torn_line(fd: int) -> bool:
    """If the file open on ``fd`` does not end with ``\n`` (a writer killed mid-line, a command that
    wrote its own JSON without one), end that line, so the torn fragment stays a bad line of its own and
    the next event is not appended onto it. Returns True when it wrote the newline."""
    try:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return False
        append_line(fd, b"\n")
    except OSError:  # a full disk: the next event may land on the fragment, where readers salvage it
        return False
    return True


def skipped_note(n: int, window: int) -> str:
    """The warning for an over-long line a reader skipped."""
    return (
        f"skipped a line of {n:,} bytes (longer than this reader's {window:,}-byte window; "
        f"events are at most {MAX_EVENT_BYTES:,} bytes when written through the event writer)"
    )


@dataclass
class LineSkipper:
    """A reader's state about over-long lines: a line with no newline within a whole read window is
    skipped, forward to its newline, however many reads that takes, so the lines after it are read.

    ``skipping`` is how many bytes of the current over-long line were skipped so far (0: none). With
    ``quiet`` the skip ends without a note (a reader that started mid-line on purpose)."""

    skipping: int = 0
    quiet: bool = False

    def start_mid_line(self) -> None:
        """The next bytes are the rest of a line we do not want (attaching near a file's end)."""
        self.skipping, self.quiet = max(self.skipping, 1), True

    def take(
        self, buf: bytes, window: int, note: Callable[[int, int], str] = skipped_note
    ) -> tuple[list[bytes], int, list[str]]:
        """``buf`` was read at the reader's offset (at most ``window`` bytes): the complete lines in it,
        how many bytes the reader advances, and a note for each over-long line that ended here."""
        used, notes = 0, []
        if self.skipping:
            nl = buf.find(b"\n")
            if nl < 0:
                self.skipping += len(buf)
                return [], len(buf), []
            used = nl + 1
            if not self.quiet:
                notes.append(note(self.skipping + used, window))
            self.skipping, self.quiet = 0, False
        lines, n = split_complete(buf[used:])
        used += n
        if not lines and len(buf) - used >= window:  # a whole window and no newline: an over-long line
            self.skipping = len(buf) - used
            used = len(buf)
        return lines, used, notes
