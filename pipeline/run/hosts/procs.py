"""Process identity and safe signalling: the only place Aerie sends a signal.

A stage is identified by the pid, process-group id and kernel start time (``/proc/PID/stat``
field 22) that its launcher recorded. Before any signal we re-read the start time of the recorded
pid: if it differs, the pid was recycled by a stranger and nothing is sent. Signals go to the
recorded process group (``killpg``), never to processes found by name.

An attempt is more than its launcher's group: a child may leave the group (``setsid``/``setpgid``, as
servers and torchrun's workers do) and a launcher may die (``kill -9``) while its stage runs on under
init. So the launcher also records a random per-attempt token, which it puts in the stage's environment
(:data:`ENV_TOKEN`); every process the stage starts inherits it. :func:`attempt_members` finds an
attempt's processes as the union of (1) its recorded process group (while the group is provably ours),
(2) live processes of this account whose ``/proc/PID/environ`` carries the token (unreadable ones are
skipped) and that started after the launcher. That is identification by a marker Aerie itself set at
launch, never by name. :func:`signal_attempt` sends to the group by ``killpg`` and to each member
outside it individually, through a pidfd opened *before* its start time is re-checked, so a pid recycled
in between is never signalled.

Why not a cgroup per attempt (what systemd does): it needs a delegated, writable cgroup v2 subtree, which
a training container rarely has (a hybrid v1 host, a container without cgroup namespace delegation, a
Slurm node whose job cgroup belongs to slurmd); the marker and the group work everywhere, unprivileged,
so they are what Aerie uses, alone. What it cannot follow: a process that re-executes itself with an emptied
environment (``env -i``) *and* leaves the group — a cgroup would catch that; documented in
docs/reliability.md.

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
    token: str = ""  # the attempt's marker in its processes' environment (ENV_TOKEN); "" for older records

    @classmethod
    def of_self(cls, token: str = "") -> ProcIdentity:
        pid = os.getpid()
        st = read_stat(pid)
        assert st is not None
        return cls(pid=pid, pgid=os.getpgid(0), start_time=st.start_time, boot_id=boot_id(), token=token)

    def to_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = {
            "pid": self.pid,
            "pgid": self.pgid,
            "start_time": self.start_time,
            "boot_id": self.boot_id,
        }
        if self.token:
            d["token"] = self.token
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ProcIdentity:
        return cls(
            int(d["pid"]),
            int(d["pgid"]),
            int(d["start_time"]),
            str(d.get("boot_id", "")),
            str(d.get("token", "")),
        )

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


class CannotSignal(RuntimeError):
    """No process of an attempt could be found to signal: the action is refused, never said done."""


class StrangerError(RuntimeError):
    """The recorded pid now belongs to another process: refusing to signal it."""


def signal_group(ident: ProcIdentity, sig: int) -> bool:
    """Send ``sig`` to the recorded process group, after checking identity.

    Returns False when the group is already gone. Raises :class:`StrangerError` when the
    recorded leader pid exists but is a different process and no member of the group is ours.
    If the leader has exited but members of its group remain (a stage's children), the group is
    still signalled: a pgid cannot be reused while any member of the group is alive. A record from
    another boot signals nothing: its group number means nothing in this one.
    """
    if ident.boot_id and ident.boot_id != boot_id():
        return False
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


# ----------------------------------------------------------------------------- an attempt's processes
ENV_TOKEN = "AERIE_ATTEMPT_TOKEN"
"""The environment variable that marks every process of one attempt (a random token, recorded in proc.json)."""


def new_token() -> str:
    return os.urandom(16).hex()  # secrets.token_hex's bytes, without importing secrets into every launcher


ENV_RUN_MARK = "AERIE_RUN_DIR"  # the run directory, in the environment of every process of its stages
ENV_STAGE_MARK = "AERIE_STAGE_ID"  # the stage (both set for the launcher and kept by the stage's env)


def _marks_of(pid: int) -> dict[str, str] | None:
    """The ``AERIE_*`` variables of a process's environment (None: gone, or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        if item.startswith(b"AERIE_"):
            key, _, value = item.partition(b"=")
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


class ProcTable:
    """Every live (non-zombie) process on this host at one moment (one pass over ``/proc``), shared by the
    stages the supervisor looks at in a tick.

    A process's attempt token is read from its environment only when asked, and only for this account's
    processes: an ``environ`` read takes the target's memory-map lock and can wait on a process stuck in
    the kernel, so it is done for the few candidates (started after an attempt's launcher, outside its
    group), never for the whole host."""

    def __init__(self) -> None:
        me, self.uid = os.getpid(), os.getuid()
        self.procs: list[tuple[ProcStat, int]] = []  # (stat, owner uid)
        self._marks: dict[tuple[int, int], dict[str, str] | None] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == me:
                continue
            st = read_stat(pid)
            if st is None or st.state in ("Z", "X", "x"):
                continue
            try:
                owner = entry.stat().st_uid
            except OSError:
                continue
            self.procs.append((st, owner))

    def marks(self, st: ProcStat, owner: int) -> dict[str, str]:
        """The ``AERIE_*`` marks in the environment of this account's process ``st`` (empty: none, or not ours)."""
        if owner != self.uid:
            return {}
        key = (st.pid, st.start_time)
        if key not in self._marks:
            self._marks[key] = _marks_of(st.pid)
        return self._marks[key] or {}

    def token(self, st: ProcStat, owner: int) -> str | None:
        """The attempt token in the environment of this account's process ``st`` (None: none, or not ours)."""
        return self.marks(st, owner).get(ENV_TOKEN)


def process_table() -> ProcTable:
    return ProcTable()


def _group_is_ours(ident: ProcIdentity) -> bool:
    """Whether processes in the recorded group are the attempt's: the leader is ours, or it is gone and
    its pid was not recycled into a new group of the same number (see :func:`signal_group`)."""
    if ident.is_same_process():
        return True
    st = read_stat(ident.pid)
    return not (st is not None and ident.pid == ident.pgid and st.pgid == ident.pgid)


def attempt_members(ident: ProcIdentity, table: ProcTable | None = None) -> list[ProcStat]:
    """Every live process of the attempt ``ident`` recorded: its launcher, its process group and the
    processes carrying its token that left the group. Empty after a reboot (start times and tokens
    belong to the boot that recorded them). ``table``: a :func:`process_table` to reuse.

    If this returns nothing for a table taken after the launcher started, the attempt has no process
    and never will again: a new member can only be forked by a live one.
    """
    if ident.boot_id and ident.boot_id != boot_id():
        return []
    group = _group_is_ours(ident)
    tab = ProcTable() if table is None else table
    out = []
    for st, owner in tab.procs:
        if st.pid == ident.pid:
            if st.start_time == ident.start_time:
                out.append(st)  # the launcher itself
            continue
        if st.start_time < ident.start_time:
            continue  # older than the attempt: not one of its processes
        if (group and st.pgid == ident.pgid) or (ident.token and tab.token(st, owner) == ident.token):
            out.append(st)
    return out


def stage_processes(run_root: str | Path, sid: str, table: ProcTable | None = None) -> list[ProcStat]:
    """Every live process of this account whose environment says it belongs to stage ``sid`` of the run at
    ``run_root`` (:data:`ENV_RUN_MARK`, :data:`ENV_STAGE_MARK`, set at launch for the launcher and kept by
    every process the stage starts), whatever attempt: how an attempt is found when ``proc.json`` is
    damaged or gone. Reads the environment of each of this account's processes: for that fault only."""
    tab = ProcTable() if table is None else table
    want = os.path.realpath(run_root)
    out = []
    for st, owner in tab.procs:
        marks = tab.marks(st, owner)
        run = marks.get(ENV_RUN_MARK)
        if (
            marks.get(ENV_STAGE_MARK) == sid
            and run
            and (run == str(run_root) or os.path.realpath(run) == want)
        ):
            out.append(st)
    return out


def describe_pids(pids: list[int], limit: int = 8) -> str:
    """'pids 1234, 1240 … and 388 more' for the operator: a long list is summarised."""
    pids = sorted(pids)
    more = f" … and {len(pids) - limit:,} more" if len(pids) > limit else ""
    return f"pid{'s' if len(pids) != 1 else ''} {', '.join(map(str, pids[:limit]))}{more}"


def describe_members(ident: ProcIdentity, members: list[ProcStat], limit: int = 8) -> str:
    """'3 processes (pgid 1234; pids 1234, 1240, 1251)' for the operator."""
    n = len(members)
    return f"{n} process{'es' if n != 1 else ''} (pgid {ident.pgid}; {describe_pids([m.pid for m in members], limit)})"


def signal_processes(members: list[ProcStat], sig: int) -> list[int]:
    """Signal each of ``members`` (seen in a process table) that is still the process seen; the pids reached."""
    return [m.pid for m in members if _signal_one(m, sig)]


def _signal_one(st: ProcStat, sig: int) -> bool:
    """Signal one process outside the recorded group, only if it is still the one that was seen.

    The pidfd is opened first and the start time checked after: the pidfd then names that very process,
    so a pid recycled between the check and the signal cannot be hit (``os.kill`` where pidfds are missing).
    """
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            fd = os.pidfd_open(st.pid)
        except OSError:
            return False
        try:
            now = read_stat(st.pid)
            if now is None or now.start_time != st.start_time:
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    now = read_stat(st.pid)
    if now is None or now.start_time != st.start_time:
        return False
    try:
        os.kill(st.pid, sig)
        return True
    except OSError:
        return False


def signal_attempt(ident: ProcIdentity, sig: int, table: ProcTable | None = None) -> list[int]:
    """Send ``sig`` to every process of the attempt: ``killpg`` to the recorded group (with the identity
    checks of :func:`signal_group`), then each member that left the group, one by one. Returns the pids of
    the members reached (empty when none lives). Raises :class:`StrangerError` as :func:`signal_group` does
    when the recorded group belongs to someone else and no process of the attempt left it."""
    members = attempt_members(ident, table)
    stranger: StrangerError | None = None
    try:
        grouped = signal_group(ident, sig)
    except StrangerError as exc:
        grouped, stranger = False, exc
    reached = []
    for m in members:
        if grouped and m.pgid == ident.pgid:
            reached.append(m.pid)  # killpg reached it
        elif _signal_one(m, sig):
            reached.append(m.pid)
    if stranger is not None and not reached:
        raise stranger
    return reached


def package_root() -> str:
    """The folder holding this ``pipeline`` package (what a child's ``PYTHONPATH`` needs)."""
    return str(
        Path(__file__).resolve().parents[3]
    )  # pipeline/run/hosts/procs.py -> the folder holding pipeline/


def env_with_pipeline(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process, with this ``pipeline`` package first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    pkg_root = package_root()
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT}
