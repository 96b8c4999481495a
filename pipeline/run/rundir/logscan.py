"""Log scanning over byte ranges: newline counts per block and regex search by line.

The console's log viewer never loads a log into memory. It keeps, per fixed-size block of the
file, how many newlines the block holds (a few bytes per 64 KiB), and asks for the lines it shows
by byte range. This module computes those counts and finds the lines that match a regex, both
over a region of a file and in bounded steps, so the same code serves a local log (the console
calls it in a thread) and a remote one (``pipeline.run.hosts.remote_agent`` runs it on the host, so a
multi-GB log is indexed and searched there and only counts and offsets cross the connection).

Standard library only; no state: every call says where to start and returns where it stopped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BLOCK = 64 << 10  # bytes per index block
READ_CHUNK = 4 << 20  # bytes read per step
COUNT_MAX_BYTES = 128 << 20  # default bytes counted per call
FIND_MAX_BYTES = 64 << 20  # default bytes searched per call
# What "jump to first error" looks for: a Python traceback or an error/fatal level word.
ERROR_PATTERN = (
    r"Traceback \(most recent call last\)|\b(?:ERROR|FATAL|CRITICAL)\b"
    r"|\b\w*(?:Error|Exception)(?::|$)|\berror:"
)

Reader = Callable[[int, int], bytes]  # (offset, length) -> bytes


class ScanError(ValueError):
    """A bad scan request (bad pattern, misaligned offset)."""


@dataclass(frozen=True)
class Matcher:
    """A compiled search: ``fold`` means "match the lower-cased bytes" (case-insensitive search)."""

    rx: re.Pattern[bytes]
    fold: bool

    def hay(self, data: bytes) -> bytes:
        return data.lower() if self.fold else data


def compile_pattern(pattern: str, ignore_case: bool | None = None) -> Matcher:
    """Compile a user's regex for byte lines; smart case (ignore case unless it has a capital).

    A case-insensitive search matches the lower-cased pattern against lower-cased bytes, which
    for ASCII folding (all ``re`` does on bytes) finds the same lines as ``re.IGNORECASE`` and
    keeps ``re``'s fast literal scan (measured 10x faster on a 280 MB log).
    """
    if ignore_case is None:
        ignore_case = pattern == pattern.lower()
    try:
        if ignore_case:
            return Matcher(re.compile(pattern.lower().encode(), re.MULTILINE), True)
        return Matcher(re.compile(pattern.encode(), re.MULTILINE), False)
    except re.error as exc:
        raise ScanError(f"bad regex {pattern!r}: {exc}") from None


def count_blocks(
    read: Reader, size: int, offset: int, max_bytes: int = COUNT_MAX_BYTES, block: int = BLOCK
) -> dict[str, Any]:
    """Newlines per complete block from ``offset`` (a multiple of ``block``).

    Returns ``counts`` (one per complete block scanned), ``end`` (where the complete blocks stop:
    the next call's offset) and, when the scan reached the end of the file, ``tail`` (newlines in
    the trailing partial block) and ``ends_nl`` (the file's last byte is a newline).
    """
    if offset % block:
        raise ScanError(f"offset {offset} is not a multiple of the block size {block}")
    stop = min(size, offset + max(block, max_bytes))
    full_end = offset + (max(0, stop - offset) // block) * block
    counts: list[int] = []
    pos = offset
    while pos < full_end:
        want = min(READ_CHUNK - READ_CHUNK % block, full_end - pos)
        data = read(pos, want)
        if len(data) < want:  # the file shrank under us: report what is certain
            full_end = pos + (len(data) // block) * block
        for i in range(0, min(len(data), full_end - pos), block):
            counts.append(data.count(b"\n", i, i + block))
        pos += min(len(data), full_end - pos)
        if len(data) < want:
            break
    out: dict[str, Any] = {"size": size, "counts": counts, "end": pos, "tail": None, "ends_nl": True}
    if pos == full_end and stop == size and size - pos < block:
        rest = read(pos, size - pos) if size > pos else b""
        out["tail"] = rest.count(b"\n")
        last = rest[-1:] if rest else (read(size - 1, 1) if size else b"\n")
        out["ends_nl"] = last == b"\n"
    return out


def find_lines(
    read: Reader,
    size: int,
    m: Matcher,
    start: int,
    end: int | None,
    line0: int,
    backward: bool = False,
    limit: int = 1000,
    max_bytes: int = FIND_MAX_BYTES,
) -> dict[str, Any]:
    """Complete lines matching ``m`` in ``[start, end)``; ``start`` and ``end`` are line starts.

    ``line0`` is the number of the line starting at ``start`` (forward) or at ``end`` (backward).
    Forward returns hits in file order, backward nearest-first; each hit is ``[line_no, offset]``.
    ``next``/``next_line`` say where to continue (forward: the line after the last one looked at;
    backward: the earliest line looked at) and ``done`` whether ``[start, end)`` is exhausted. A
    final line without its newline is not looked at: it is still being written.
    """
    end = size if end is None else min(end, size)
    if backward:
        return _find_backward(read, size, m, start, end, line0, limit, max_bytes)
    hits: list[list[int]] = []
    pos, ln, scanned, done = start, line0, 0, False
    while len(hits) < limit:
        if pos >= end:
            done = True
            break
        if scanned >= max_bytes:
            break
        data = m.hay(read(pos, min(READ_CHUNK, end - pos)))
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if len(data) < READ_CHUNK or pos + len(data) >= end:
                done = True  # only an unfinished last line is left
                break
            cut = len(data)  # one line longer than a chunk: looked at in pieces
        at, counted, cur = 0, 0, ln
        while at < cut:
            hit = m.rx.search(data, at, cut)
            if hit is None:
                at = cut
                break
            ls = data.rfind(b"\n", 0, hit.start()) + 1
            cur += data.count(b"\n", counted, ls)
            counted = ls
            hits.append([cur, pos + ls])
            nl = data.find(b"\n", hit.start(), cut)
            at = cut if nl < 0 else nl + 1
            if len(hits) >= limit:
                break
        ln += data.count(b"\n", 0, at)
        pos += at
        scanned += at
    return {"size": size, "hits": hits, "next": pos, "next_line": ln, "done": done}


def _find_backward(
    read: Reader, size: int, m: Matcher, start: int, end: int, line0: int, limit: int, max_bytes: int
) -> dict[str, Any]:
    hits: list[list[int]] = []
    pos, ln, scanned = end, line0, 0
    while pos > start and scanned < max_bytes and len(hits) < limit:
        cstart = max(start, pos - READ_CHUNK)
        data = m.hay(read(cstart, pos - cstart))
        if cstart > start:
            first = data.find(b"\n") + 1  # the chunk starts mid-line: begin at the next line
            data = data[first:]
            cstart += first
        found: list[int] = []
        at = 0
        while at < len(data):
            hit = m.rx.search(data, at)
            if hit is None or hit.start() >= len(data):
                break
            found.append(data.rfind(b"\n", 0, hit.start()) + 1)
            nl = data.find(b"\n", hit.start())
            if nl < 0:
                break
            at = nl + 1
        prev, cur = len(data), ln
        for ls in reversed(found):
            cur -= data.count(b"\n", ls, prev)
            prev = ls
            hits.append([cur, cstart + ls])
            if len(hits) >= limit:
                break
        if len(hits) >= limit:
            pos, ln = cstart + prev, cur
            break
        ln -= data.count(b"\n")
        scanned += pos - cstart
        pos = cstart
    return {"size": size, "hits": hits, "next": pos, "next_line": ln, "done": pos <= start}


# ------------------------------------------------------------------------------ on a file
def _file_reader(fd: int) -> Reader:
    return lambda off, n: os.pread(fd, n, off) if n > 0 else b""


def count_file(
    path: str | os.PathLike[str], offset: int, max_bytes: int = COUNT_MAX_BYTES, block: int = BLOCK
) -> dict[str, Any]:
    """:func:`count_blocks` on a file; adds ``ino``. A missing file has ``size`` -1."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return {"size": -1, "ino": 0, "counts": [], "end": offset, "tail": None, "ends_nl": True}
    try:
        st = os.fstat(fd)
        if st.st_size < offset:  # truncated or replaced: the caller starts over
            return {
                "size": st.st_size,
                "ino": st.st_ino,
                "counts": [],
                "end": offset,
                "tail": None,
                "ends_nl": True,
            }
        out = count_blocks(_file_reader(fd), st.st_size, offset, max_bytes, block)
        out["ino"] = st.st_ino
        return out
    finally:
        os.close(fd)


def find_file(
    path: str | os.PathLike[str],
    pattern: str,
    start: int,
    end: int | None,
    line0: int,
    backward: bool = False,
    limit: int = 1000,
    max_bytes: int = FIND_MAX_BYTES,
    ignore_case: bool | None = None,
) -> dict[str, Any]:
    """:func:`find_lines` on a file; adds ``ino``. A missing file has ``size`` -1 and no hits."""
    matcher = compile_pattern(pattern, ignore_case)
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return {"size": -1, "ino": 0, "hits": [], "next": start, "next_line": line0, "done": True}
    try:
        st = os.fstat(fd)
        out = find_lines(_file_reader(fd), st.st_size, matcher, start, end, line0, backward, limit, max_bytes)
        out["ino"] = st.st_ino
        return out
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ why a stage failed
_EXC_LINE = re.compile(
    r"^\s*(?:[A-Za-z_][\w.]*\.)?(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt)|[A-Z]\w*Error)"
    r"(?::.*)?$"
)
_ERROR_WORD = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|^error:", re.IGNORECASE)
_BANNER = re.compile(r"^===== aerie: ")
_COMMAND_ECHO = re.compile(r"^===== \$ ")  # the launcher's echo of what it started, never a reason
ERROR_TAIL_BYTES = 16 << 10  # how much of a log's end :func:`last_error_line` needs
ERROR_LINE_MAX = 2000  # whole refusals (a provenance one names two fingerprints and the fields that differ)


def last_error_line(tail: str) -> str:
    """The line that says why a stage failed, from the end of its log (its last attempt).

    The last exception line of a traceback (``ModelAssetError: the demo model is missing …``), else
    the last ``ERROR``/``FATAL``/``error:`` line, else the last non-empty line; "" for an empty log.
    Only the lines after the last attempt banner count, so an older attempt's error is never shown.
    """
    lines = [ln.rstrip() for ln in tail.replace("\r", "\n").splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _BANNER.match(lines[i]):
            lines = lines[i + 1 :]
            break
    lines = [ln for ln in lines if ln.strip() and not _COMMAND_ECHO.match(ln)]
    if not lines:
        return ""
    pick = ""
    in_tb = any(ln.startswith("Traceback (most recent call last)") for ln in lines)
    for ln in reversed(lines):
        if in_tb and not ln.startswith((" ", "\t")) and _EXC_LINE.match(ln):
            pick = ln
            break
    if not pick:
        pick = next((ln for ln in reversed(lines) if _ERROR_WORD.search(ln)), lines[-1])
    pick = pick.strip()
    if in_tb and _EXC_LINE.match(pick):  # pipeline.data.model_assets.ModelAssetError: … -> ModelAssetError: …
        head, sep, rest = pick.partition(":")
        pick = head.rsplit(".", 1)[-1] + sep + rest
    return pick if len(pick) <= ERROR_LINE_MAX else pick[: ERROR_LINE_MAX - 1] + "…"
