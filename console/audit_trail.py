"""The run's audit log as the console reads it: ``RUN/audit.jsonl`` through the transport, incrementally.

Like the model's event streams, it asks the transport for the bytes appended since its offset (so over
SSH only new lines cross the link) and keeps the last :attr:`AuditTrail.KEEP` entries, whatever the
log's length; attaching to a long run starts at the log's last 256 KiB. An unreadable line is named in
:attr:`AuditTrail.problems`; an unterminated last line — a write a crash cut short — in
:attr:`AuditTrail.torn` (never shown as an entry). Parsing is :func:`pipeline.run.rundir.audit.parse`, the one
the CLI uses.

When the log is rotated (``audit.jsonl`` renamed to ``audit.1.jsonl`` past its size limit, see
:mod:`pipeline.run.rundir.growth`) the trail notices the new inode, reads the rest of the old generation
(found by its inode among ``audit.N.jsonl``) and goes on with the new file from its start: the
entries shown stay, and none is lost or shown twice.
"""

from __future__ import annotations

from collections import deque

from console.transport import Transport
from pipeline.run.rundir import growth
from pipeline.run.rundir.audit import AUDIT_FILE, TAIL_BYTES, AuditEntry, parse


class AuditTrail:
    KEEP = 1000  # entries kept
    MAX_PROBLEMS = 20
    CHUNK = 1 << 20  # bytes read per poll

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.entries: deque[AuditEntry] = deque(maxlen=self.KEEP)
        self.problems: deque[str] = deque(maxlen=self.MAX_PROBLEMS)
        self.torn: str | None = None
        self.total = 0  # entries read since attaching (the log may hold more before the tail read)
        self.loaded = False  # one poll answered
        self.exists = False
        self.skipped_head = False  # attached past the start of a long log
        self._offset = 0
        self._line = 1
        self._ino = 0

    async def poll(self) -> bool:
        """Read what was appended; True when something changed."""
        res = (await self.transport.read_many([(AUDIT_FILE, self._offset)], max_bytes=self.CHUNK))[0]
        first = not self.loaded
        self.loaded = True
        if res.size < 0:
            self.exists = False
            return first
        self.exists = True
        if self._ino and res.ino and res.ino != self._ino:
            # rotated: finish the old generation, then the new file from its start (entries stay)
            await self._finish_rotated()
            self._offset, self._line, self._ino = 0, 1, res.ino
            await self.poll()
            return True
        if res.size < self._offset:
            self._reset()  # cut in place: read it again, from its start
            await self.poll()
            return True
        self._ino = res.ino or self._ino
        data = res.data
        if self._offset == 0 and res.size > TAIL_BYTES and not self.skipped_head:
            self.skipped_head = True
            self._offset = res.size - TAIL_BYTES
            data = (await self.transport.read_many([(AUDIT_FILE, self._offset)], max_bytes=TAIL_BYTES))[
                0
            ].data
            cut = data.find(b"\n") + 1  # from the first whole line
            self._offset += cut
            data = data[cut:]
        end = data.rfind(b"\n") + 1
        complete, tail = data[:end], data[end:]
        torn = None
        if tail and self._offset + len(data) >= res.size:  # an unterminated last line of the file
            torn = parse(tail, first_line=self._line + complete.count(b"\n"), where=self._where).problems[0]
        changed = bool(complete) or torn != self.torn
        self.torn = torn
        if complete:
            read = parse(complete, first_line=self._line, where=self._where)
            self.entries.extend(read.entries)
            self.problems.extend(read.problems)
            self.total += len(read.entries)
            self._line += complete.count(b"\n")
            self._offset += len(complete)
        return changed or first

    async def _finish_rotated(self) -> None:
        """Read what is left of the generation we were reading, now ``audit.N.jsonl`` (found by inode)."""
        for n in range(1, growth.keep("audit") + 1):
            rel = growth.generation_name(AUDIT_FILE, n)
            offset, line = self._offset, self._line
            while True:
                res = (await self.transport.read_many([(rel, offset)], max_bytes=self.CHUNK))[0]
                if res.size < 0 or res.ino != self._ino:
                    break  # not ours: look one generation further
                end = res.data.rfind(b"\n") + 1
                if end:
                    read = parse(res.data[:end], first_line=line, where=rel)
                    self.entries.extend(read.entries)
                    self.problems.extend(read.problems)
                    self.total += len(read.entries)
                    line += res.data[:end].count(b"\n")
                    offset += end
                if not end or offset + (len(res.data) - end) >= res.size:
                    return  # its end (a rotated file gets nothing more)
            if res.size >= 0 and res.ino == self._ino:
                return

    @property
    def _where(self) -> str:
        return f"{AUDIT_FILE} (from its last 256 KiB)" if self.skipped_head else AUDIT_FILE

    def _reset(self) -> None:
        self.entries.clear()
        self.problems.clear()
        self.torn = None
        self.total = 0
        self._offset, self._line, self._ino = 0, 1, 0
        self.skipped_head = False
