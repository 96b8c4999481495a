"""The run's audit log, ``RUN/audit.jsonl``: who did what to which stage, from where, and what came of it.

Every control action (pause, resume, kill, retry, retry --fresh, skip, force) reaches the run through
``pipeline.run.supervise.ctl`` on the executing host, whichever front end sent it (the console, the ``aerie``
CLI, the browser console of ``aerie serve``; locally or over SSH). ctl puts the front end (``via``)
and the operator (``who``, ``user@host`` where the front end runs) into the request; the
supervisor appends the outcome when it acts on the request (``done`` or ``refused`` with its reason),
so a line is written even when the ctl that asked died waiting. ctl itself appends what the
supervisor never sees: a request refused before it was queued (an unknown stage), and ``timed out``
when no answer came in time (the request stays queued; the supervisor's line follows when it acts).

One entry is one JSON object on one line::

    {"t": "2026-12-01T06:13:20.123Z", "ts": 1796...., "who": "ana@laptop", "via": "console",
     "action": "retry", "stage": "train", "outcome": "done", "message": "...", "fresh": true,
     "account": "aerie@gpu-box"}

``t`` is UTC; ``fresh`` only on ``retry --fresh``; ``account`` (the account ctl ran as on the host)
only when it differs from ``who``. Lines are appended with one ``write`` to the file opened
``O_APPEND`` and fsynced (the directory too when the file is created), so concurrent writers never
interleave and a line that was reported written survives a crash or a power cut. A crash *during* a
write can leave a torn last line: readers skip it and report it, and the next append starts on a new
line, so it never corrupts the entry after it. Standard library only (the console reads it too).

The file is 0600. Past 16 MiB (:mod:`pipeline.run.rundir.growth`; ~60,000 entries) the appender that passed
the limit renames it to ``audit.1.jsonl`` (older ones shift to ``.2`` … ``.4``, the oldest is dropped),
holding an exclusive ``flock`` on it as every appender does, so no entry lands in a generation after it
was renamed. :func:`read_tail` and the console's audit view read the newest entries across that boundary.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.rundir import growth
from pipeline.run.rundir.files import append_line, fsync_dir

AUDIT_FILE = "audit.jsonl"
FRONT_ENDS = ("console", "cli", "browser", "ctl")  # ctl: pipeline.run.supervise.ctl run by hand
ACTIONS = ("pause", "resume", "kill", "retry", "skip", "force", "ack", "silence")  # ack/silence: an alert
OUTCOMES = ("done", "refused", "timed out")
TAIL_BYTES = 256 << 10  # what a reader of the last entries reads at most


def identity() -> str:
    """``user@host`` of this process (the uid when the user has no name here)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def entry(
    action: str,
    stage: str,
    outcome: str,
    message: str = "",
    *,
    via: str = "ctl",
    who: str = "",
    account: str = "",
    fresh: bool = False,
    ts: float | None = None,
) -> dict[str, Any]:
    """One audit entry as it is written."""
    ts = time.time() if ts is None else ts
    who = who or identity()
    rec: dict[str, Any] = {
        "t": utc(ts),
        "ts": round(ts, 3),
        "who": who,
        "via": via,
        "action": action,
        "stage": stage,
        "outcome": outcome,
        "message": message,
    }
    if fresh:
        rec["fresh"] = True
    if account and account != who:
        rec["account"] = account
    return rec


def append(run_root: Path | str, rec: dict[str, Any]) -> None:
    """Append one entry to ``RUN/audit.jsonl``: one ``write``, then fsync (see the module docstring);
    rotate it when it passed its limit."""
    path = Path(run_root) / AUDIT_FILE
    data = json.dumps(rec, ensure_ascii=True) + "\n"
    created = not path.exists()
    fd = growth.open_locked(path, os.O_RDWR | os.O_APPEND)  # 0600; no rotation until we close it
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = "\n" + data  # a torn last line (a crash mid-write): ours starts on a line of its own
        append_line(fd, data.encode())
        os.fsync(fd)
        limit = growth.limit("audit")
        if limit and os.fstat(fd).st_size >= limit:
            try:
                growth.rotate_file(path, growth.keep("audit"))
                created = True
            except OSError:
                pass  # the entry is written; the rotation is tried again by the next append
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def record_request(run_root: Path | str, req: dict[str, Any], ok: bool, message: str) -> None:
    """The supervisor's line for a control request it acted on (``req`` as ctl queued it)."""
    append(
        run_root,
        entry(
            str(req.get("action", "")),
            str(req.get("stage", "")),
            "done" if ok else "refused",
            message,
            via=str(req.get("via") or "ctl"),
            who=str(req.get("who") or "unknown"),
            account=str(req.get("account") or ""),
            fresh=bool(req.get("fresh")),
        ),
    )


@dataclass
class AuditEntry:
    """One entry as read back."""

    ts: float
    who: str
    via: str
    action: str
    stage: str
    outcome: str
    message: str = ""
    fresh: bool = False
    account: str = ""

    @property
    def what(self) -> str:
        """The action as typed: ``retry --fresh``."""
        return f"{self.action} --fresh" if self.fresh else self.action

    @property
    def time_utc(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.ts))

    def line(self) -> str:
        """One line for ``aerie status``."""
        outcome = (
            f"{self.outcome}: {self.message}" if self.message and self.outcome != "done" else self.outcome
        )
        return f"{self.time_utc}Z  {self.who} via {self.via}  {self.what} {self.stage}  {outcome}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditEntry:
        return cls(
            ts=float(d["ts"]),
            who=str(d["who"]),
            via=str(d["via"]),
            action=str(d["action"]),
            stage=str(d["stage"]),
            outcome=str(d["outcome"]),
            message=str(d.get("message") or ""),
            fresh=bool(d.get("fresh")),
            account=str(d.get("account") or ""),
        )

    def to_dict(self) -> dict[str, Any]:
        return entry(
            self.action,
            self.stage,
            self.outcome,
            self.message,
            via=self.via,
            who=self.who,
            account=self.account,
            fresh=self.fresh,
            ts=self.ts,
        )


@dataclass
class AuditRead:
    """Entries read from some bytes of the log, and what could not be read (each naming the line)."""

    entries: list[AuditEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    lines: int = 0  # complete lines seen (entries + unreadable ones)


def parse(data: bytes, first_line: int = 1, where: str = AUDIT_FILE) -> AuditRead:
    """Parse the log's bytes; ``first_line`` is the line number of the first byte's line.

    An unreadable line is skipped and named; an unterminated last line is a write a crash cut short
    (reported as torn, never taken as an entry)."""
    out = AuditRead()
    *complete, tail = data.split(b"\n")
    for i, raw in enumerate(complete):
        if not raw.strip():
            continue
        out.lines += 1
        try:
            out.entries.append(AuditEntry.from_dict(json.loads(raw)))
        except (ValueError, KeyError, TypeError) as exc:
            out.problems.append(
                f"{where} line {first_line + i}: unreadable entry skipped ({exc}): {_clip(raw)}"
            )
    if tail.strip():
        out.problems.append(
            f"{where} line {first_line + len(complete)}: torn last line (a write cut short by a crash), "
            f"ignored: {_clip(tail)}"
        )
    return out


def _clip(raw: bytes, n: int = 80) -> str:
    text = raw.decode(errors="replace")
    return repr(text if len(text) <= n else text[:n] + "…")


def read_tail(run_root: Path | str, n: int = 10, max_bytes: int = TAIL_BYTES) -> tuple[AuditRead, int]:
    """The last ``n`` entries of ``RUN/audit.jsonl`` and its rotated generations (reading at most
    ``max_bytes`` of each one's end) and how many lines they hold in all. No file: nothing, 0."""
    path = Path(run_root) / AUDIT_FILE
    out, total = AuditRead(), 0
    for p in [path, *growth.generations(path, growth.keep("audit"))]:
        try:
            if len(out.entries) < n:
                read, lines = _file_tail(p, max_bytes)
                out.entries[:0] = read.entries
                out.problems[:0] = read.problems
                out.lines += read.lines
            else:
                lines = _count_lines(p)
        except FileNotFoundError:
            continue
        total += lines
    out.entries = out.entries[-n:] if n else []
    return out, total


def _count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b""))


def _file_tail(path: Path, max_bytes: int) -> tuple[AuditRead, int]:
    """The entries of the last ``max_bytes`` of one file, and how many lines it holds."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - max_bytes)
        head_lines = 0
        if start:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":  # mid-line: skip to the next line's start
                fh.readline()
                start = fh.tell()
            fh.seek(0)
            left = start
            while left > 0:  # line numbers stay true: count the newlines of the head
                block = fh.read(min(1 << 20, left))
                head_lines += block.count(b"\n")
                left -= len(block)
        fh.seek(start)
        read = parse(fh.read(size - start), first_line=head_lines + 1, where=str(path))
    return read, head_lines + read.lines


def status_section(run_root: Path | str, n: int = 10) -> dict[str, Any]:
    """What ``aerie status`` shows of the log (``ctl status`` sends it from the host): the last ``n``
    entries, how many lines the log holds, and what could not be read."""
    tail, total = read_tail(run_root, n)
    return {"entries": [e.to_dict() for e in tail.entries], "total": total, "problems": tail.problems}


def section_lines(section: dict[str, Any]) -> list[str]:
    """``aerie status``'s text for a :func:`status_section`: a heading and a line per entry."""
    entries = [AuditEntry.from_dict(e) for e in section.get("entries", [])]
    if not entries:
        return []
    head = f"audit log (last {len(entries)} of {int(section.get('total') or 0)}; RUN/{AUDIT_FILE}):"
    return ["", head, *(f"  {e.line()}" for e in entries)]
