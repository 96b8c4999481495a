"""The run's alert records as the console reads them: ``RUN/alerts.jsonl`` (:mod:`pipeline.run.alerts.record`),
followed through the transport like the events — locally, over SSH, in the browser console.

The supervisor raises, clears and delivers alerts on the executing host; this only folds the file's lines into
:class:`~pipeline.run.alerts.record.AlertRecord` s, so every console, however many and whenever attached, lists
the same alerts. Reads only what was appended since the last poll; when the file was rotated (its inode
changed, or it shrank) it reads the new file from its start, whose head carries every record still open, and
keeps the records it already had. No Textual.
"""

from __future__ import annotations

from pipeline.run.alerts import record
from pipeline.run.alerts.record import AlertRecord

ALERTS_PATH = record.ALERTS_FILE


class AlertFeed:
    def __init__(self) -> None:
        self.book: dict[int, AlertRecord] = {}
        self.offset = 0
        self.ino = 0
        self.loaded = False  # the file was read once (absent counts): toasts are for what comes after
        self._partial = b""

    def read_request(self) -> tuple[str, int]:
        return ALERTS_PATH, self.offset

    def ingest(self, data: bytes, size: int, ino: int) -> bool:
        """Fold what was read; True when a record changed."""
        first = not self.loaded
        self.loaded = True
        if size < 0:
            return first
        if (self.ino and ino and ino != self.ino) or size < self.offset:
            self.offset, self._partial = 0, b""  # rotated: the next poll reads the new file from its start
            self.ino = ino
            return False
        self.ino = ino or self.ino
        buf = self._partial + data
        end = buf.rfind(b"\n") + 1
        self._partial = buf[end:]
        self.offset += len(data)
        if not end:
            return False
        lines, _bad = record.parse(buf[:end])
        for line in lines:
            record.apply(self.book, line)
        return bool(lines)

    def ordered(self) -> list[AlertRecord]:
        """Open ones first, newest first (as ``aerie status`` lists them)."""
        return record.ordered(self.book)

    def open_stages(self) -> dict[str, list[AlertRecord]]:
        """Each stage's open alerts (the board marks those stages)."""
        out: dict[str, list[AlertRecord]] = {}
        for r in self.book.values():
            if r.open and r.stage:
                out.setdefault(r.stage, []).append(r)
        return out
