"""One supervisor per run, and whether it lives: the run's lock and the liveness report every front end shows.

**The lock** is an ``flock`` on the run directory itself (``os.open(RUN, O_RDONLY | O_DIRECTORY)``; flock
works on directories on Linux). Unlike a lock *file*, the locked object cannot be deleted or replaced from
under the holder: deleting ``supervisor.lock`` or ``supervisor.json`` under a live run and then sending a
control action does not start a second supervisor. The fd is close-on-exec, so the stages a supervisor
launches never inherit it, and it is released by the kernel when the supervisor dies however it dies.
``supervisor.lock`` is still created and flocked, best effort, so an older Aerie's ``ctl`` sees the lock
too, and a supervisor of an older Aerie (which holds only that file) is respected.

**Probing** the lock (:func:`lock_held`) takes a *shared* lock for an instant and releases it: probes never
block each other, and a supervisor starting at that instant retries its exclusive lock for half a second
(:func:`try_lock`) rather than mistake a probe for a rival. The holders are named from ``/proc/locks``
(:func:`lock_holders`), so "which process supervises this run" is a fact of the kernel, checked against
``supervisor.json`` (information only: pid, start time; rewritten by the supervisor if deleted).

**Liveness** (:func:`liveness`) combines the lock with the age of the last snapshot in ``state.json``: a
supervisor that holds the lock but has written no snapshot for :data:`STALE_S` is *silent*: it "cannot write"
when a write is known to have failed (the run directory was made read-only, a disk failed, an alert of a
failed write), else it is *slow* (a long tick on a loaded host: nothing failed); one that holds no lock is
*dead*. A heartbeat
in the run directory could not tell these apart on a read-only directory; the lock can.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from pipeline.run.hosts.procs import ProcIdentity
from pipeline.run.projection.text import span
from pipeline.run.rundir.layout import RunDir, read_json

HEARTBEAT_S = 2.0  # the supervisor rewrites state.json at least this often (its "t" moves)
STALE_S = 12.0  # no new snapshot for this long: the supervisor is silent (lock held) or dead (no lock)
LOCK_RETRY_S = 0.5  # a supervisor starting retries its lock this long (a probe holds it for microseconds)


def _open_dir(root: Path) -> int | None:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _legacy_held(root: Path) -> bool:
    """A supervisor of an older Aerie holds ``supervisor.lock`` only."""
    try:
        fd = os.open(root / "supervisor.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def try_lock(root: Path, retry_s: float = LOCK_RETRY_S) -> tuple[int, int | None] | None:
    """The run's exclusive lock: ``(dir_fd, legacy_fd)`` to keep open while supervising, or ``None`` when
    another supervisor holds it. ``legacy_fd`` is ``supervisor.lock``'s (``None`` where it cannot be made,
    e.g. on a read-only run directory)."""
    fd = _open_dir(root)
    if fd is None:
        return None
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)
    legacy: int | None = None
    try:
        legacy = os.open(root / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(legacy, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # an older Aerie's supervisor runs this run
        assert legacy is not None
        os.close(legacy)
        os.close(fd)
        return None
    except OSError:  # cannot create it (read-only directory): the directory lock is the one that counts
        if legacy is not None:
            os.close(legacy)
        legacy = None
    return fd, legacy


def lock_held(root: Path) -> bool:
    """True when some supervisor holds the run's lock (probed with a shared lock, released at once)."""
    fd = _open_dir(root)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return _legacy_held(root)


def lock_holders(root: Path) -> list[int]:
    """The pids holding an exclusive flock on the run directory, from ``/proc/locks`` (empty where it
    cannot be read). One entry per lock: more than one pid would mean two supervisors."""
    try:
        st = os.stat(root)
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    for line in table.splitlines():
        f = line.split()
        if "->" in f:  # a waiter, not a holder
            continue
        if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "WRITE" and f[5] == want:
            with contextlib.suppress(ValueError):
                pids.append(int(f[4]))
    return sorted(set(pids))


def write_problem(root: Path) -> str | None:
    """Why the run directory cannot be written now (read-only mount, immutable, permissions), or None.
    ``access(2)`` answers without writing anything."""
    try:
        if os.access(root, os.W_OK):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)
    err = errno.EACCES
    with contextlib.suppress(OSError):
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            err = errno.EROFS
    return f"{errno.errorcode.get(err, '')} {os.strerror(err)}".strip()


def _recorded(run: RunDir) -> dict[str, Any]:
    try:
        rec = read_json(run.supervisor_path)
    except (ValueError, OSError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _pid_alive(rec: dict[str, Any]) -> bool:
    try:
        return ProcIdentity.from_dict(rec).is_alive()
    except (KeyError, TypeError, ValueError):
        return False


def liveness(run: RunDir, state: dict[str, Any] | None, now: float | None = None) -> dict[str, Any]:
    """Whether the run's supervisor lives, from its lock, ``supervisor.json`` and the snapshot's age.

    ``verdict``: ``running``; ``silent`` (holds the lock, no snapshot for :data:`STALE_S`); ``dead`` (no
    lock, the run not finished); ``finished`` (no lock, every stage finished: nothing to supervise).
    ``text`` is the one line front ends print (they add what they do about it)."""
    now = time.time() if now is None else now
    state = state if isinstance(state, dict) else {}
    sup = state.get("supervisor") if isinstance(state.get("supervisor"), dict) else {}
    assert isinstance(sup, dict)
    rec = _recorded(run)
    seen = sup.get("t") if isinstance(sup.get("t"), int | float) else None
    if seen is None and isinstance(rec.get("t"), int | float):  # no snapshot yet: since it started
        seen = rec["t"]
    age = None if seen is None else max(0.0, now - float(seen))
    held = lock_held(run.root)
    holders = lock_holders(run.root) if held else []
    pid = holders[0] if holders else rec.get("pid", sup.get("pid"))
    alive = bool(holders) or _pid_alive(rec)
    problem = write_problem(run.root) if held and (age is None or age > STALE_S) else None
    old = age is not None and age >= 86400  # another day: the date too
    last = time.strftime("%Y-%m-%d %H:%M" if old else "%H:%M:%S", time.localtime(seen)) if seen else "never"
    ago = f"{span(age)} ago" if age is not None else "no snapshot yet"
    if held:
        if age is not None and age <= STALE_S:
            verdict, text = "running", f"supervisor pid {pid} · last snapshot {ago}"
        else:
            silent = f"silent for {span(age)}" if age is not None else "has written no snapshot yet"
            who = f"pid {pid} alive" if alive else "pid unknown, lock held"
            failed = problem or _last_alert(sup, "write_failed")
            if failed:  # a write failed (or cannot be done): said so, with why
                verdict, text = "silent", f"supervisor {silent} ({who}, cannot write: {failed})"
            else:  # nothing failed that we know of: a long tick, a loaded host — slow, not broken
                slow = f"slow: no snapshot for {span(age)}" if age is not None else "slow: no snapshot yet"
                verdict, text = (
                    "silent",
                    f"supervisor {slow} ({who}, no write has failed; see supervisor.log)",
                )
    elif state.get("done"):
        verdict, text = "finished", f"supervisor exited: the run is finished (last seen {last})"
    else:
        verdict, text = "dead", f"supervisor dead (last seen {last}, {ago})"
    return {
        "verdict": verdict,
        "text": text,
        "lock_held": held,
        "holders": holders,
        "pid": pid,
        "pid_alive": alive,
        "last_seen": seen,
        "age_s": None if age is None else round(age, 1),
        "write_problem": problem,
    }


def _last_alert(sup: dict[str, Any], code: str) -> str | None:
    """The text of the latest open alert of ``code`` in the last snapshot (None: none)."""
    alerts = [
        a
        for a in sup.get("alerts") or []
        if isinstance(a, dict) and not a.get("resolved") and a.get("code") == code
    ]
    return str(alerts[-1].get("text")) if alerts else None
