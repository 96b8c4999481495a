"""A full disk, named: which device, mounted where, how much is free.

When a write fails with ``ENOSPC`` (or ``EDQUOT``) the operator needs to know *which* filesystem
filled — the run directory may sit on a different device from the dataset cache — so every
"no space left" message Aerie writes goes through :func:`describe`:
``no space left on device tmpfs (tmpfs at /data/runs, 0 B free of 2.0 MiB)``.

Only the standard library; it runs on the executing host.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

NOSPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NOSPACE_TEXT = ("No space left on device", "Disk quota exceeded")


def is_nospace(exc: BaseException) -> bool:
    """True for an OSError meaning the filesystem (or the quota) is full, however it was wrapped."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NOSPACE_ERRNOS:
            return True
        if any(t in str(exc) for t in NOSPACE_TEXT):  # pyarrow and others re-raise with the text only
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field) >= i + 4 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: Path | str) -> tuple[str, str, str]:
    """(device/source, filesystem type, mount point) of the filesystem holding ``path``."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    target = os.path.realpath(p)
    best = ("?", "?", "/")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mnt = _unescape(fields[4])
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[2]):  # the longest (latest, for equal) mount point wins
            best = (_unescape(rfields[1]), rfields[0], mnt)
    return best


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(path: Path | str) -> str:
    """``no space left on device SOURCE (FSTYPE at MOUNT, FREE free of TOTAL)`` for ``path``'s filesystem."""
    source, fstype, mnt = mount_of(path)
    try:
        st = os.statvfs(Path(path) if Path(path).exists() else mnt)
        room = f", {_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)}"
    except OSError:
        room = ""
    return f"no space left on device {source} ({fstype} at {mnt}{room})"
