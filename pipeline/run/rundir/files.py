"""Writing files that survive a kill or a power cut: atomic writes, JSON state, directory swaps, fsync, hashes.

The one place these are done (standard library only), for the run machinery and every stage:

* :func:`write_atomic` / :func:`write_json` — a temp file in the same directory, fsync, rename: a reader
  sees the old file or the new one, never a torn one;
* :func:`publish` — the same last step for a file a library wrote (Parquet, safetensors): fsync it,
  rename it to its name, optionally fsync the directory so the rename itself is durable;
* :func:`swap_dir` — a finished directory (a checkpoint, the best draft) replaces the old one;
* :func:`append_line` — one whole line appended to an ``O_APPEND`` file with a single ``write``, or
  nothing (a write cut short by a full disk is rolled back);
* :func:`sha256_file` — a file's sha256, read in 1 MiB blocks;
* :func:`private_dir` / :func:`open_private` — every directory and file Aerie creates in a run directory
  is 0700/0600 whatever the umask: the mode is passed to ``mkdir``/``open`` *and* set again with
  ``chmod``/``fchmod`` after (a umask can only remove bits, and a file left by an older version or a
  looser umask is tightened when opened again). Logs, events and the audit trail hold prompts, paths
  and who did what: on a shared login node they are nobody else's business (Jupyter's runtime files,
  ``~/.ssh``). :func:`write_atomic`'s temp file is created 0600, exclusively.

It imports little (``hashlib`` and ``shutil`` only where used, no ``tempfile``): every launcher imports it at
start, and a burst of launches pays that import once per process (docs/performance.md, "Launches").
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any

from pipeline.run.rundir.private_fd import PRIVATE_FILE, open_private

PRIVATE_DIR = 0o700


def private_dir(path: Path | str) -> Path:
    """Create ``path`` (and any missing parent) as 0700 whatever the umask; an existing one is left as is."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.parent != path:
        private_dir(path.parent)
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        if not path.is_dir():
            raise
        return path
    os.chmod(path, PRIVATE_DIR)  # the umask may have removed bits we asked for; it never adds any
    return path


def open_private_append(path: Path | str, text: bool = False) -> IO[Any]:
    """A private file opened for appending (``"ab"``, or line-buffered ``"a"`` with ``text``)."""
    fd = open_private(path, os.O_WRONLY | os.O_APPEND)
    return os.fdopen(fd, "a", buffering=1) if text else os.fdopen(fd, "ab")


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path, sync_dir: bool = False) -> None:
    """Give the finished file ``tmp`` its name ``path``: fsync its data, then rename (atomic on one
    filesystem); with ``sync_dir`` the directory too, so the new name survives a power cut."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(Path(path).parent)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new file, never a torn one."""
    path = Path(path)
    private_dir(path.parent)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new 0600 file beside ``path`` (``.NAME.PID.RANDOM.partial``), created exclusively: ``mkstemp``'s
    guarantee without importing ``tempfile`` (and ``random``, ``shutil``) into every launcher."""
    while True:
        tmp = str(path.parent / f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.partial")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE), tmp
        except FileExistsError:
            continue


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


class CorruptFileError(ValueError):
    """A state file that is not valid JSON (or not text); ``path`` names it, ``detail`` says what is wrong."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: corrupt state file: {detail}")
        self.path = Path(path)
        self.detail = detail


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON in ``path``; ``default`` when there is no such file; a corrupt file is a
    :class:`CorruptFileError` (a ``ValueError``) naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
    except ValueError as exc:  # UnicodeDecodeError too
        raise CorruptFileError(Path(path), str(exc)) from None


def swap_dir(tmp: Path, final: Path) -> None:
    """Replace the directory ``final`` with the finished ``tmp``. The old one is first renamed aside
    (``final.old``), so at every moment ``final`` is whole: the old, the new, or — only between the two
    renames — absent with the old one intact beside it; it is removed once the new one is in place."""
    import shutil

    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def append_line(fd: int, data: bytes) -> None:
    """Append ``data`` (one line, newline included) to ``fd`` (opened ``O_APPEND``) whole, or nothing.

    One ``write``, so concurrent appenders never interleave bytes. A write that fails part-way
    (``ENOSPC`` after some bytes reached the file) is rolled back with ``ftruncate`` to where the line
    started, then the error is raised: a full disk never leaves a torn line behind."""
    n = os.write(fd, data)
    if n == len(data):
        return
    end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND: our bytes end here
    start = end - n
    try:
        while n < len(data):
            n += os.write(fd, data[n:])
    except OSError:
        if os.fstat(fd).st_size == start + n:  # nobody appended after us meanwhile
            os.ftruncate(fd, start)
        raise


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
