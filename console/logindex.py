"""The log viewer's model: a line index of one run-dir log, kept current through the transport.

Nothing here holds the log. :class:`LogIndex` keeps the cumulative newline count of every 64 KiB
block (8 bytes per block: a 10 GB log costs 1.3 MB) and answers "lines N..N+k" by reading the one
or two blocks they live in (a small LRU of blocks). The counts come from the transport's
``count_lines``, which runs where the file is (``pipeline.run.rundir.logscan``; over SSH on the host), so a
multi-GB log is indexed without crossing the connection, and :meth:`LogIndex.update` only scans
what was appended since the last call. Until the first scan reaches the end of a long file,
:meth:`LogIndex.tail_lines` gives the last lines straight from the file's end, so the viewer opens
at once.

:class:`LogFilter` is the same for a regex filter: the line numbers and byte offsets of the
matching lines (bounded), found by the transport's ``find_lines`` and extended as the log grows.
Lines are decoded as UTF-8 (bad bytes replaced), ANSI escapes dropped and carriage-return
rewrites (progress bars) shown as the terminal would leave them.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

from console.transport import Transport
from pipeline.run.rundir.logscan import BLOCK, compile_pattern

MAX_LINE_BYTES = 16 << 10  # a longer line is shown cut, with a marker
CUT_MARK = " …[line cut]"
BLOCK_CACHE = 64  # blocks kept (4 MiB)
TAIL_BYTES = 256 << 10  # what tail_lines reads from the end of a file not yet indexed
UPDATE_CALLS = 8  # count_lines calls per update (each scans up to 128 MiB)
MAX_HITS = 1_000_000  # filter matches kept (16 bytes each); the oldest are dropped beyond
ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def clean(raw: bytes) -> str:
    """One log line as text: UTF-8 (replaced), no ANSI escapes, the last carriage-return rewrite."""
    if len(raw) > MAX_LINE_BYTES:
        return clean(raw[:MAX_LINE_BYTES]) + CUT_MARK
    text = raw.decode("utf-8", errors="replace")
    if "\x1b" in text:
        text = ANSI_RE.sub("", text)
    if "\r" in text:
        text = text.rstrip("\r")
        text = text.rsplit("\r", 1)[-1]
    return text.expandtabs(4) if "\t" in text else text


@dataclass
class Row:
    """One row the viewer shows: its line number (0-based; None while unknown) and text."""

    line: int | None
    text: str


class LogIndex:
    """Block newline counts of one run-relative log file; lines read on demand."""

    def __init__(self, transport: Transport, path: str, block: int = BLOCK) -> None:
        self.transport = transport
        self.path = path
        self.block = block
        self.cum = array("Q")  # cum[i]: newlines in blocks 0..i
        self.indexed_to = 0  # end of the complete blocks counted
        self.tail_nl = 0  # newlines after indexed_to
        self.size = -1  # -1: missing (or not looked at yet)
        self.ino = 0
        self.ends_nl = True
        self.caught_up = False  # the last scan reached the end of the file
        self.resets = 0  # times the file was replaced or truncated
        self.version = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        # Enough blocks that a line starting in the first one is complete, or cut at MAX_LINE_BYTES.
        self._span_blocks = 2 + MAX_LINE_BYTES // block

    # ------------------------------------------------------------------------------ counts
    @property
    def newlines(self) -> int:
        return (self.cum[-1] if self.cum else 0) + self.tail_nl

    @property
    def lines(self) -> int:
        """Lines in the file, counting an unfinished last line."""
        return self.newlines + (1 if self.size > 0 and not self.ends_nl else 0)

    @property
    def fraction_indexed(self) -> float:
        if self.caught_up or self.size <= 0:
            return 1.0
        return min(1.0, self.indexed_to / self.size)

    def reset(self) -> None:
        self.cum = array("Q")
        self.indexed_to, self.tail_nl, self.ends_nl, self.caught_up = 0, 0, True, False
        self._blocks.clear()

    async def update(self, calls: int = UPDATE_CALLS) -> bool:
        """Count what was appended since the last call; True when the file's lines changed."""
        changed = False
        for _ in range(calls):
            r = await self.transport.count_lines(self.path, self.indexed_to, block=self.block)
            size, ino = int(r["size"]), int(r.get("ino") or 0)
            if size < 0:
                if self.size >= 0:
                    self.reset()
                    self.size, changed = -1, True
                break
            if (self.ino and ino and ino != self.ino) or size < self.indexed_to or size < self.size:
                self.reset()  # replaced or truncated: index it again from the start
                self.resets += 1
                self.ino, self.size, changed = ino, 0, True
                continue
            before = (self.lines, self.size, self.ends_nl)
            self.ino = ino
            last = self.cum[-1] if self.cum else 0
            for c in r["counts"]:
                last += c
                self.cum.append(last)
            self.indexed_to = int(r["end"])
            self.size = size
            if r.get("tail") is not None:
                self.tail_nl, self.ends_nl, self.caught_up = int(r["tail"]), bool(r["ends_nl"]), True
            else:
                self.tail_nl, self.ends_nl, self.caught_up = 0, True, False
            if (self.lines, self.size, self.ends_nl) != before:
                changed = True
            if self.caught_up:
                break
        if changed:
            self.version += 1
        return changed

    # ------------------------------------------------------------------------------ reading
    def _locate(self, n: int) -> tuple[int, int]:
        """(block, newlines before it) for the block holding the newline that ends line n-1."""
        if n <= 0 or not self.cum:
            return 0, 0
        b = bisect_left(self.cum, n)
        return b, (self.cum[b - 1] if b > 0 else 0)

    async def _span(self, first: int, count: int) -> bytes:
        """Blocks first..first+count-1 concatenated (complete blocks cached; the tail block never)."""
        want = [b for b in range(first, first + count) if b * self.block < max(self.size, 0)]
        have = {b: self._blocks[b] for b in want if b in self._blocks}
        missing = [b for b in want if b not in have]
        if missing:
            res = await self.transport.read_many(
                [(self.path, b * self.block) for b in missing], max_bytes=self.block
            )
            for b, r in zip(missing, res, strict=True):
                have[b] = r.data
                if len(r.data) == self.block and (b + 1) * self.block <= self.indexed_to:
                    self._blocks[b] = r.data
                    if len(self._blocks) > BLOCK_CACHE:
                        self._blocks.popitem(last=False)
        parts = []
        for b in want:
            if b in self._blocks:
                self._blocks.move_to_end(b)
            parts.append(have[b])
            if len(have[b]) < self.block:
                break
        return b"".join(parts)

    async def line_start(self, n: int) -> int:
        """Byte offset where line n starts (the file's size for n == lines)."""
        if n <= 0:
            return 0
        if n >= self.lines:
            return max(self.size, 0)
        b, before = self._locate(n)
        i = _skip_lines(await self._span(b, 1), 0, n - before)
        return b * self.block + max(i, 0)

    async def read_lines(self, first: int, count: int) -> list[Row]:
        """Lines first..first+count-1 (fewer at the end of the file)."""
        total = self.lines
        first = max(0, first)
        count = min(count, total - first)
        out: list[Row] = []
        n = first
        while n < first + count:
            b, before = self._locate(n)
            data = await self._span(b, self._span_blocks)
            i = _skip_lines(data, 0, n - before)
            if i < 0:
                break  # the file changed under the index; the next update re-reads it
            while n < first + count:
                j = data.find(b"\n", i)
                if j < 0:
                    # The unfinished last line, or one longer than MAX_LINE_BYTES (shown cut), or
                    # one running past these blocks: the next line is located afresh from the index.
                    if len(data) - i >= MAX_LINE_BYTES:
                        out.append(Row(n, clean(data[i : i + MAX_LINE_BYTES]) + CUT_MARK))
                        n += 1
                    elif b * self.block + len(data) >= self.size:
                        out.append(Row(n, clean(data[i:])))
                        n += 1
                    break
                out.append(Row(n, clean(data[i:j])))
                n += 1
                i = j + 1
        return out

    async def tail_lines(self, count: int) -> list[Row]:
        """The last lines, read from the end of the file (line numbers unknown until indexed)."""
        if self.size <= 0:
            return []
        start = max(0, self.size - TAIL_BYTES)
        res = (await self.transport.read_many([(self.path, start)], max_bytes=self.size - start))[0]
        data = res.data
        if start > 0:
            data = data[data.find(b"\n") + 1 :]
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        return [Row(None, clean(raw)) for raw in lines[-count:]]


def _skip_lines(data: bytes, i: int, k: int) -> int:
    """Offset just past the k-th newline from ``i`` (-1 if ``data`` has fewer)."""
    for _ in range(k):
        j = data.find(b"\n", i)
        if j < 0:
            return -1
        i = j + 1
    return i


class LogFilter:
    """The lines of a log matching a regex: line numbers and offsets, bounded, kept current."""

    def __init__(self, index: LogIndex, pattern: str) -> None:
        self.index = index
        self.pattern = pattern
        compile_pattern(pattern)  # a bad regex raises ScanError here, before anything is sent
        self.lines = array("Q")
        self.offsets = array("Q")
        self.next = 0
        self.next_line = 0
        self.done = False
        self.dropped = 0
        self._resets = index.resets

    @property
    def count(self) -> int:
        return len(self.lines)

    @property
    def fraction_scanned(self) -> float:
        size = self.index.size
        return 1.0 if self.done or size <= 0 else min(1.0, self.next / size)

    async def update(self, calls: int = 4, limit: int = 20_000) -> bool:
        """Search what the index knows beyond the last scan; True when matches were added."""
        if self._resets != self.index.resets:
            self.lines, self.offsets = array("Q"), array("Q")
            self.next = self.next_line = self.dropped = 0
            self._resets = self.index.resets
        added = False
        self.done = False
        for _ in range(calls):
            r = await self.index.transport.find_lines(
                self.index.path, self.pattern, self.next, None, self.next_line, limit=limit
            )
            for ln, off in r["hits"]:
                self.lines.append(ln)
                self.offsets.append(off)
            added = added or bool(r["hits"])
            self.next, self.next_line = int(r["next"]), int(r["next_line"])
            if len(self.lines) > MAX_HITS:
                drop = len(self.lines) - MAX_HITS + MAX_HITS // 10
                del self.lines[:drop]
                del self.offsets[:drop]
                self.dropped += drop
            if r["done"]:
                self.done = True
                break
        return added

    async def read_rows(self, first: int, count: int) -> list[Row]:
        first = max(0, first)
        sel = range(first, min(first + count, len(self.lines)))
        if not sel:
            return []
        res = await self.index.transport.read_many(
            [(self.index.path, self.offsets[i]) for i in sel], max_bytes=MAX_LINE_BYTES + 1
        )
        out = []
        for i, r in zip(sel, res, strict=True):
            data = r.data
            nl = data.find(b"\n")
            out.append(Row(self.lines[i], clean(data if nl < 0 else data[:nl])))
        return out

    def row_of_line(self, line: int) -> int:
        """Index of the first match at or after ``line``."""
        return bisect_left(self.lines, line)
