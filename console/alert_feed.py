"""The run's alert records as the console reads them: ``RUN/alerts.jsonl`` (:mod:`pipeline.run.alerts.record`),
followed through the transport like the events — locally, over SSH, in the browser console.

The supervisor raises, clears and delivers alerts on the executing host; this only folds the file's lines into
:class:`~pipeline.run.alerts.record.AlertRecord` s, so every console, however many and whenever attached, lists
the same alerts. Reads only what was appended since the last poll; when the file was rotated (its inode
changed, or it shrank) it reads the new file from its start, whose head carries every record still open, and
keeps the records it already had. The first read (:meth:`AlertFeed.load`) takes the kept rotated generations
too (``alerts.2.jsonl``, ``alerts.1.jsonl``, oldest first, then the file: what
:func:`pipeline.run.alerts.record.read` folds for ``aerie status``), so a record cleared and acknowledged before
the last rotation is listed by a console or ``aerie watch`` attached after it as well. No Textual.
"""

from __future__ import annotations

from console.transport import WHOLE_CHUNK, Transport, read_whole
from pipeline.run.alerts import record
from pipeline.run.alerts.record import AlertRecord
from pipeline.run.rundir import growth

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

    async def load(self, transport: Transport) -> set[str]:
        """The first read (nothing once loaded): the kept rotated generations, each whole, oldest first, then
        the file from its start (one batched read, so a rotation can hardly fall between them; a line read twice
        folds the same). ``{"alerts"}`` when a record came. Later polls go on with :meth:`read_request` /
        :meth:`ingest`."""
        if self.loaded:
            return set()
        gens = [growth.generation_name(ALERTS_PATH, n) for n in range(growth.keep("alerts"), 0, -1)]
        got = await transport.read_many([(g, 0) for g in gens] + [(ALERTS_PATH, 0)], max_bytes=WHOLE_CHUNK)
        changed = False
        for rel, first in zip(gens, got, strict=False):
            res = await read_whole(transport, rel, first) if first.size > 0 else None
            for line in record.parse(res.data)[0] if res is not None else []:
                record.apply(self.book, line)
                changed = True
        cur = got[-1]
        return {"alerts"} if self.ingest(cur.data, cur.size, cur.ino) or changed else set()

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
