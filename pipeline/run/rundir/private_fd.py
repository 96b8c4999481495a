"""A file of ours, opened 0600 whatever the umask (``os`` only).

The one small piece of :mod:`pipeline.run.rundir.files` that a stage's log writer needs at start: it is
imported by every launch, so it imports nothing but ``os`` (docs/performance.md, "Launches").
"""

from __future__ import annotations

import os

PRIVATE_FILE = 0o600


def tighten(fd: int, mode: int = PRIVATE_FILE) -> None:
    """``fchmod`` an open file of ours to ``mode`` when it allows more (group/other bits)."""
    st = os.fstat(fd)
    if st.st_mode & 0o777 != mode and st.st_uid == os.geteuid():
        try:  # noqa: SIM105 (contextlib costs every launch an import)
            os.fchmod(fd, mode)
        except OSError:  # a filesystem without modes (some FUSE, vfat): nothing to do
            pass


def open_private(path: os.PathLike[str] | str, flags: int, mode: int = PRIVATE_FILE) -> int:
    """``os.open(path, flags | O_CREAT, mode)``, then :func:`tighten`: a file only its owner can read."""
    fd = os.open(path, flags | os.O_CREAT, mode)
    try:
        tighten(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd
