"""How big a run's bookkeeping files may grow, and the rotation that keeps them there.

A run can last a week: a training emitting progress ~4/s and a metric per step, a regeneration of
100K samples, an inference server that logs every request. Without a bound its ``events.jsonl``,
``stage.log``, ``audit.jsonl`` and ``supervisor.log`` would grow until the disk is full. Each is
rotated by size into numbered generations (``events.jsonl`` -> ``events.1.jsonl`` -> ``events.2.jsonl``;
``stage.log`` -> ``stage.1.log``), the oldest dropped, so a file kind never takes more than
``limit * (keep + 1)`` bytes (docs/reliability.md, "Growth", has the arithmetic per day of a run).

========================  ===========  ====  ==================================================
file                      limit        keep  how
========================  ===========  ====  ==================================================
``stages/*/events.jsonl`` 64 MiB       3     the writer renames it (``rotate_file``) under an
                                             ``flock``; the new file starts with the *carried*
                                             summary (:func:`pipeline.run.rundir.events.carry_lines`)
``stages/*/stage.log``    256 MiB      2     the stage's log writer renames it (the stage's
                                             stdout is a pipe to that process:
                                             :mod:`pipeline.run.stage_side.log_writer`)
``audit.jsonl``           16 MiB       4     the appender renames it, under an ``flock``
``supervisor.log``        16 MiB       2     the supervisor reopens it (:class:`RotatingLog`)
========================  ===========  ====  ==================================================

The limits are constants, not plan settings (nothing about a plan changes how much history an operator
needs to keep). ``AERIE_ROTATE_BYTES_EVENTS``, ``_LOG``, ``_AUDIT`` and ``_SUPERVISOR`` in the
environment override a limit, for tests and for an operator who wants a different bound (set it where
the supervisor starts; stages inherit it): :func:`limit` is the one place they are read.

Appenders that share a file with a rotator (:class:`SharedAppender`) hold a shared ``flock`` on their
fd while they check that it is still the file at the path and write; the rotator holds an exclusive
one on the old file while it renames. So once a rotation is done no byte lands in the old generation,
and a reader that finishes the old generation and goes on with the new file loses and repeats nothing.
On a filesystem without ``flock`` (some network mounts) the lock is skipped and an event written in the
instant of a rotation may land at the end of the old generation instead; so it is when a holder does
not let go within :data:`LOCK_WAIT_S` (a paused stage, SIGSTOPped inside a write): the writer writes
unlocked rather than wait for the resume, and a rotation is put off.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pipeline.run.rundir.files import append_line, open_private, open_private_append
from pipeline.run.rundir.rotation_limits import RETRY_BYTES, keep, limit

LOCK_WAIT_S = 5.0  # the longest an appender waits for a rotation (or a rotator for appenders) to finish


def bound(kind: str) -> int:
    """The most bytes one file of ``kind`` takes with its generations (a line may pass the limit)."""
    return limit(kind) * (keep(kind) + 1)


# ------------------------------------------------------------------------------- generations
def generation(path: Path, n: int) -> Path:
    """``events.jsonl``, n=2 -> ``events.2.jsonl``; ``stage.log`` -> ``stage.2.log`` (n=0: the file)."""
    path = Path(path)
    if n == 0:
        return path
    return path.with_name(f"{path.stem}.{n}{path.suffix}")


def generation_name(name: str, n: int) -> str:
    """The same for a run-relative name (``stages/a/events.jsonl``), as the console asks for it."""
    head, _, base = name.rpartition("/")
    stem, dot, suffix = base.rpartition(".")
    if not dot:
        stem, suffix = base, ""
    rotated = f"{stem}.{n}.{suffix}" if suffix else f"{stem}.{n}"
    return (f"{head}/" if head else "") + (base if n == 0 else rotated)


def generations(path: Path, keep_n: int) -> list[Path]:
    """The rotated generations of ``path``, newest first (``.1``, ``.2``, …), whether they exist or not."""
    return [generation(path, n) for n in range(1, keep_n + 1)]


def find_generation(path: Path, ino: int, keep_n: int) -> tuple[int, Path, os.stat_result] | None:
    """Which rotated generation of ``path`` is the file with inode ``ino`` (a reader's old file)."""
    for n, p in enumerate(generations(path, keep_n), start=1):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if st.st_ino == ino:
            return n, p, st
    return None


def _shift(path: Path, keep_n: int) -> None:
    """``.k-1`` -> ``.k`` … ``.1`` -> ``.2``: the oldest kept generation is overwritten (dropped)."""
    for n in range(keep_n - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(generation(path, n), generation(path, n + 1))


def rotate_file(path: Path, keep_n: int, head: bytes = b"") -> None:
    """Rename ``path`` to its first generation and put a new file holding ``head`` at ``path``.

    The name never goes missing: the old file is hard-linked as ``.1`` and the new one renamed over
    ``path`` (where hard links are refused it is renamed, leaving ``path`` absent for an instant)."""
    path = Path(path)
    _shift(path, keep_n)
    first = generation(path, 1)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(first)  # keep_n == 1: the only generation is replaced
    tmp = path.with_name(f".{path.name}.rotating")
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            if head:
                append_line(fd, head)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(path, first)
        except OSError:
            os.replace(path, first)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _flock(fd: int, op: int, wait_s: float | None = None) -> bool:
    """``flock`` that waits at most ``wait_s``; False when it was not taken.

    Bounded because a lock holder can be frozen: a paused stage is SIGSTOPped wherever it is, maybe
    inside a write or a rotation, and the supervisor's own event writes must never wait for its resume.
    Past the wait a writer writes unlocked (its line may then land at the end of the old generation,
    the race the lock otherwise closes) and a rotation is put off. No flock on this filesystem: the same."""
    if op == fcntl.LOCK_UN:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, op)
        return True
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        except OSError:
            return False


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def open_locked(path: Path, flags: int) -> int:
    """A private fd on the file now at ``path`` holding an exclusive ``flock`` (closing it unlocks): what
    an appender that may rotate (the audit log) opens, so no rotation runs between its check and write."""
    for _ in range(100):
        fd = open_private(path, flags)
        _flock(fd, fcntl.LOCK_EX)  # not taken within LOCK_WAIT_S (a frozen holder): append unlocked
        if _same_file(path, fd):
            return fd
        os.close(fd)  # rotated while we waited: the new file
    raise OSError(f"{path}: replaced 100 times while opening it")


class SharedAppender:
    """An ``O_APPEND`` file several processes append whole lines to, rotated by whichever passes the limit.

    ``head(path, prepared)`` gives the lines the new generation starts with (read from the old one);
    ``prepare(path)``, when given, is called first, *outside* the rotation's lock (its result is
    ``prepared``), so the long part of reading the old generation never holds up the other writers: they
    wait on the lock only for what ``head`` reads of the bytes they appended meanwhile, and the rename."""

    def __init__(
        self,
        path: Path,
        kind: str,
        head: Callable[[Path, Any], bytes] | None = None,
        limit_bytes: int | None = None,
        on_open: Callable[[int], object] | None = None,
        prepare: Callable[[Path], Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.kind = kind
        self.on_open = on_open  # called with each fd opened (read-write): e.g. end a torn last line
        self.limit = limit(kind) if limit_bytes is None else limit_bytes
        self.keep = keep(kind)
        self.head = head
        self.prepare = prepare
        self._retry_at = 0  # after a failed rotation: the size at which to try again
        self.fd = self._open()

    def _open(self) -> int:
        fd = open_private(self.path, os.O_RDWR | os.O_APPEND)
        if self.on_open is not None:
            self.on_open(fd)
        return fd

    def _reopen(self) -> None:
        fd = self._open()
        os.close(self.fd)
        self.fd = fd

    def append(self, data: bytes) -> None:
        """Append one whole line to the file now at the path (following a rotation), then rotate if due.

        Only the append's own error is raised: a rotation that fails (a full disk) leaves the file as it
        is and is tried again once it has grown by another :data:`RETRY_BYTES`."""
        for _ in range(100):
            _flock(self.fd, fcntl.LOCK_SH)
            if _same_file(self.path, self.fd):
                break
            _flock(self.fd, fcntl.LOCK_UN)
            try:
                self._reopen()
            except FileNotFoundError:  # its directory is gone: write on where we were, as before
                _flock(self.fd, fcntl.LOCK_SH)
                break
        try:
            append_line(self.fd, data)
            size = os.fstat(self.fd).st_size
        finally:
            _flock(self.fd, fcntl.LOCK_UN)
        if self.limit and size >= max(self.limit, self._retry_at):
            try:
                self.rotate()
                self._retry_at = 0
            except OSError:
                self._retry_at = size + RETRY_BYTES

    def rotate(self) -> None:
        prepared = None
        if self.prepare is not None and self.head is not None:
            with contextlib.suppress(OSError, ValueError):
                prepared = self.prepare(self.path)
        if not _flock(self.fd, fcntl.LOCK_EX):
            raise OSError(f"{self.path}: a writer holds it (frozen?): rotation put off")
        try:
            # another appender may have rotated it while we waited for the lock
            if _same_file(self.path, self.fd) and os.fstat(self.fd).st_size >= self.limit:
                rotate_file(self.path, self.keep, self.head(self.path, prepared) if self.head else b"")
        finally:
            _flock(self.fd, fcntl.LOCK_UN)
        self._reopen()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------------------- stage logs
def read_tail(path: Path, nbytes: int, keep_n: int | None = None) -> bytes:
    """The last ``nbytes`` of ``path``, continued back into its first rotated generation when the file is
    shorter (a log rotated just before the line that says why a stage failed)."""
    keep_n = keep("log") if keep_n is None else keep_n
    parts: list[bytes] = []
    left = nbytes
    for p in [Path(path), *generations(Path(path), min(keep_n, 1))]:
        try:
            with open(p, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                fh.seek(max(0, size - left))
                data = fh.read(left)
        except OSError:
            break
        parts.insert(0, data)
        left -= len(data)
        if left <= 0:
            break
    return b"".join(parts)


class RotatingLog:
    """The supervisor's own log: a line-buffered text file reopened under a new one past its limit.

    When this process's stdout/stderr are that file (``spawn_detached`` points them there, for a
    traceback) they follow it to the new file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.limit = limit("supervisor")
        self.keep = keep("supervisor")
        self.fh: IO[Any] = open_private_append(self.path, text=True)

    def write(self, text: str) -> int:
        n = self.fh.write(text)
        if self.limit and os.fstat(self.fh.fileno()).st_size >= self.limit:
            self.rotate()
        return n

    def rotate(self) -> None:
        st = os.fstat(self.fh.fileno())
        old = (st.st_dev, st.st_ino)
        self.fh.close()
        rotate_file(self.path, self.keep)
        self.fh = open_private_append(self.path, text=True)
        for std in (1, 2):
            with contextlib.suppress(OSError):
                sst = os.fstat(std)
                if (sst.st_dev, sst.st_ino) == old:
                    os.dup2(self.fh.fileno(), std)

    def flush(self) -> None:
        self.fh.flush()

    def fileno(self) -> int:
        return self.fh.fileno()

    def close(self) -> None:
        self.fh.close()
