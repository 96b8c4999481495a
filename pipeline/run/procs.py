"""Process identity and safe signalling: the only place Aerie sends a signal.

A stage is identified by the pid, process-group id and kernel start time (``/proc/PID/stat``
field 22) that its launcher recorded. Before any signal we re-read the start time of the recorded
pid: if it differs, the pid was recycled by a stranger and nothing is sent. Signals go to the
recorded process group only (``killpg``), never to processes found by name.

Liveness reads the process state: a zombie (``Z``) or dead (``X``) process counts as gone, because
a detached process whose parent exited can stay a zombie until PID 1 reaps it and ``kill -0``
still succeeds on it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgid: int
    start_time: int  # clock ticks since boot


def read_stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/PID/stat``; ``None`` when the process does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm is in parentheses and may itself contain spaces or ')': split at the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return ProcStat(pid=pid, state=rest[0], ppid=int(rest[1]), pgid=int(rest[2]), start_time=int(rest[19]))


def start_time(pid: int) -> int | None:
    st = read_stat(pid)
    return st.start_time if st else None


def boot_id() -> str:
    """Identifies this boot: start times are only comparable within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class ProcIdentity:
    """What a launcher records about itself so it can be found again, and only it."""

    pid: int
    pgid: int
    start_time: int
    boot_id: str

    @classmethod
    def of_self(cls) -> ProcIdentity:
        pid = os.getpid()
        st = read_stat(pid)
        assert st is not None
        return cls(pid=pid, pgid=os.getpgid(0), start_time=st.start_time, boot_id=boot_id())

    def to_dict(self) -> dict[str, int | str]:
        return {"pid": self.pid, "pgid": self.pgid, "start_time": self.start_time, "boot_id": self.boot_id}

    @classmethod
    def from_dict(cls, d: dict) -> ProcIdentity:
        return cls(int(d["pid"]), int(d["pgid"]), int(d["start_time"]), str(d.get("boot_id", "")))

    def is_same_process(self) -> bool:
        """True when the recorded pid still is the process we launched (not a recycled pid)."""
        if self.boot_id and self.boot_id != boot_id():
            return False
        st = read_stat(self.pid)
        return st is not None and st.start_time == self.start_time

    def is_alive(self) -> bool:
        st = read_stat(self.pid)
        if st is None or st.start_time != self.start_time:
            return False
        if self.boot_id and self.boot_id != boot_id():
            return False
        return st.state not in ("Z", "X", "x")

    def is_stopped(self) -> bool:
        st = read_stat(self.pid)
        return st is not None and st.start_time == self.start_time and st.state in ("T", "t")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = read_stat(int(entry.name))
        if st and st.pgid == pgid and st.state not in ("Z", "X"):
            out.append(st.pid)
    return out


class StrangerError(RuntimeError):
    """The recorded pid now belongs to another process: refusing to signal it."""


def signal_group(ident: ProcIdentity, sig: int) -> bool:
    """Send ``sig`` to the recorded process group, after checking identity.

    Returns False when the group is already gone. Raises :class:`StrangerError` when the
    recorded leader pid exists but is a different process and no member of the group is ours.
    If the leader has exited but members of its group remain (a stage's children), the group is
    still signalled: a pgid cannot be reused while any member of the group is alive.
    """
    if ident.is_same_process():
        try:
            os.killpg(ident.pgid, sig)
            return True
        except ProcessLookupError:
            return False
    # Leader gone or recycled. The group id stays reserved while any member lives, so members
    # whose pgid equals the recorded one are our stage's (grand)children, unless the leader pid
    # itself was recycled into a *new* group with the same number, which needs the leader to be
    # alive and a stranger: then refuse.
    st = read_stat(ident.pid)
    if st is not None and ident.pid == ident.pgid and st.pgid == ident.pgid:
        raise StrangerError(
            f"pid {ident.pid} was recycled (start time {st.start_time} != recorded {ident.start_time}); not signalling"
        )
    if not group_members(ident.pgid):
        return False
    try:
        os.killpg(ident.pgid, sig)
        return True
    except ProcessLookupError:
        return False


def env_with_pipeline(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process, with this ``pipeline`` package first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    pkg_root = str(
        Path(__file__).resolve().parents[2]
    )  # pipeline/run/procs.py -> the folder holding pipeline/
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT}
