"""The stage log writer: ``python -m pipeline.run.stage_side.log_writer LOG`` copies its stdin to ``LOG`` (the
local executor runs this file by path, ``python -S …/log_writer.py``).

A stage's stdout and stderr are a pipe to this small process, the shape of daemontools' ``multilog`` and
Apache's ``rotatelogs``: it appends what it reads to ``stage.log`` and, when the next bytes would take the
file past its limit (256 MiB, :mod:`pipeline.run.rundir.growth`), renames it to ``stage.1.log`` (older
generations shift; the oldest is dropped) and goes on in a new ``stage.log``. So

* a stage's output never passes through the supervisor's loop, however fast it is written: a stage that
  writes faster than the disk takes is slowed by the full pipe (back-pressure), and nothing is copied;
* the log is bounded at ``limit × (kept + 1)`` bytes for any writer speed, and it is never lost whole:
  rotation drops only the oldest generation;
* the current file always holds the latest bytes (it rotates *before* a write, never after one), so the
  stage's last lines — where a failure says why — are in ``stage.log``; a line is cut at the limit only
  when it alone is longer than what is left;
* it is neither the launcher nor the supervisor: the executor starts it in a session of its own, outside
  the attempt's process group, so ``aerie kill`` never stops it before the stage's last words are written,
  and the stage outlives the death of the supervisor or of the launcher. It ends when every process
  holding the pipe's write end has ended (end of file). It ignores SIGTERM, SIGINT and SIGHUP; a write
  that fails (a full disk) loses those bytes, counted, and a line saying how many is written as soon as a
  write succeeds again: a stage is never blocked by a full disk on its log.
"""

from __future__ import annotations

import _signal  # signal's C core: the ``signal`` module imports ``enum`` (~7 ms a launch) for names only
import errno
import fcntl
import os
import sys
import time

from pipeline.run.rundir import rotation_limits
from pipeline.run.rundir.private_fd import open_private

READ_BYTES = 1 << 16  # one read of the pipe
PIPE_BYTES = 1 << 20  # the pipe's buffer, asked for (Linux caps it at /proc/sys/fs/pipe-max-size)


class StageLog:
    """``stage.log`` and its generations, appended to by one writer that rotates it by rename."""

    def __init__(
        self, path: os.PathLike[str] | str, limit: int | None = None, keep: int | None = None
    ) -> None:
        self.path = os.fspath(path)
        self.limit = rotation_limits.limit("log") if limit is None else limit
        self.keep = rotation_limits.keep("log") if keep is None else keep
        self.lost = 0  # bytes a failed write lost since the last successful one
        self.fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first whenever it would pass the limit (at its last newline that fits)."""
        while data:
            if self.limit and self.size >= self.limit:
                self.size = os.fstat(self.fd).st_size  # another appender (Slurm's notes) may have written
                if self.size >= self.limit:
                    self.rotate()
                    continue
            room = self.limit - self.size if self.limit else len(data)
            if len(data) <= room:
                self._append(data)
                return
            nl = data.rfind(b"\n", 0, room)
            cut = nl + 1 if nl >= 0 else room
            self._append(data[:cut])
            data = data[cut:]
            self.size = max(self.size, self.limit)  # what is left starts a new generation

    def _append(self, data: bytes) -> None:
        if self.lost:
            note = f"----- aerie: {self.lost:,} bytes of output lost: the log could not be written -----\n"
            if not self._write_all(note.encode()):
                self.lost += len(data)
                return
            self.lost = 0
        if not self._write_all(data):
            self.lost += len(data)

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except OSError:
                return False
            self.size += n
            view = view[n:]
        return True

    def rotate(self) -> None:
        """``stage.log`` -> ``stage.1.log`` (renamed, never copied) and a new ``stage.log`` that says so."""
        from pathlib import Path  # the first rotation, not every launch, pays these imports

        from pipeline.run.rundir import growth

        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        path = Path(self.path)
        head = (
            f"----- aerie: {path.name} rotated {stamp}: the {self.size:,} bytes before are in "
            f"{growth.generation(path, 1).name} -----\n"
        ).encode()
        try:
            growth.rotate_file(path, self.keep, head)
            fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:  # a full disk: go on in the file we have; tried again past RETRY_BYTES
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
                raise
            self.size = self.limit - rotation_limits.RETRY_BYTES
            return
        os.close(self.fd)
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def close(self) -> None:
        if self.lost:
            self._append(b"")
        os.close(self.fd)


def pump(fd_in: int, log: StageLog) -> None:
    """Copy ``fd_in`` to ``log`` until end of file (every writer of the pipe has closed it)."""
    try:  # noqa: SIM105 (contextlib costs every launch an import)
        fcntl.fcntl(fd_in, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass
    while True:
        try:
            data = os.read(fd_in, READ_BYTES)
        except InterruptedError:
            continue
        if not data:
            return
        log.write(data)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m pipeline.run.stage_side.log_writer LOG  (copies stdin to LOG)", file=sys.stderr
        )
        return 2
    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
        _signal.signal(sig, _signal.SIG_IGN)  # it ends at end of file, after the stage's last words
    os.umask(0o077)
    log = StageLog(argv[0])
    try:
        pump(0, log)
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
