"""The supervisor's own trouble, survived and said: alerts, their log lines and the backoff of retried writes.

A supervisor must outlive what goes wrong around it, as a database reports a write error and carries on
(SQLite, Postgres): a run directory made read-only or immutable for a while (``EROFS``, ``EPERM``,
``EACCES``), a failing disk (``EIO``), a full one (``ENOSPC``), a per-stage file someone corrupted. Each such
fault becomes an :class:`Alert` in :class:`Faults`: logged to ``supervisor.log`` when it starts (then at most
once a minute while it lasts, and when it ends), written into ``state.json``'s ``supervisor.alerts`` as soon
as a write succeeds again, and kept there :data:`KEEP_RESOLVED_S` after it ended so an operator who looks
later still sees what happened. :class:`Backoff` spaces the retries of a failing write (0.5 s doubling to
30 s) so a dead disk is not hammered; reading and signalling go on at the normal poll.

:class:`GuardedRunDir` reads a damaged ``attempt.json`` as the attempt the supervisor last knew (and says so).
:func:`describe_os_error` and :func:`stage_file_problem` give the words: the errno and what it means, the
file (relative to the run directory) and what is wrong with it.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.run.hosts import nospace
from pipeline.run.rundir.files import CorruptFileError, read_json
from pipeline.run.rundir.layout import RunDir, StageDir

LOG_EVERY_S = 60.0  # a lasting fault is logged again at most this often
KEEP_RESOLVED_S = 600.0  # an ended fault stays in state.json this long
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0

# Per-stage records the supervisor reads, in the order a diagnosis checks them.
STAGE_RECORDS = (
    "attempt.json",
    "launch.json",
    "proc.json",
    "exit.json",
    "kill.json",
    "skip.json",
    "force.json",
    "slurm.json",
    "pause",
)


@dataclass
class Alert:
    code: str  # write_failed | corrupt_file | tick_failed | spec_fallback
    text: str
    since: float
    path: str | None = None
    stage: str | None = None
    last: float = 0.0
    count: int = 1
    resolved: float | None = None


class Faults:
    """The supervisor's open and recently ended alerts, by key (one per fault, however often it recurs)."""

    def __init__(self, log: Callable[[str], None], clock: Callable[[], float] = time.time) -> None:
        self.log = log
        self.clock = clock
        self.alerts: dict[str, Alert] = {}
        self._logged: dict[str, float] = {}

    def report(
        self, code: str, key: str, text: str, path: Path | str | None = None, stage: str | None = None
    ) -> None:
        now = self.clock()
        a = self.alerts.get(key)
        if a is None or a.resolved is not None:
            a = self.alerts[key] = Alert(code, text, now, str(path) if path else None, stage, now)
            self._logged[key] = now
            self.log(f"ALERT {code}: {text}")
            return
        a.text, a.last, a.count = text, now, a.count + 1
        if now - self._logged.get(key, 0.0) >= LOG_EVERY_S:
            self._logged[key] = now
            self.log(f"ALERT {code} (still, {a.count} times since {_hms(a.since)}): {text}")

    def resolve(self, key: str) -> None:
        a = self.alerts.get(key)
        if a is not None and a.resolved is None:
            a.resolved = self.clock()
            self.log(f"resolved {a.code} after {a.resolved - a.since:.0f}s: {a.text}")

    def open_keys(self, code: str | None = None, stage: str | None = None) -> list[str]:
        return [
            k
            for k, a in self.alerts.items()
            if a.resolved is None and (code is None or a.code == code) and (stage is None or a.stage == stage)
        ]

    def section(self) -> list[dict[str, Any]]:
        """The alerts for ``state.json``: open ones, and those that ended less than KEEP_RESOLVED_S ago."""
        now = self.clock()
        for k in [k for k, a in self.alerts.items() if a.resolved and now - a.resolved > KEEP_RESOLVED_S]:
            del self.alerts[k]
        return [asdict(a) for a in sorted(self.alerts.values(), key=lambda a: a.since)]


class Backoff:
    """When to try a failing write again: 0.5 s after the first failure, doubling to 30 s; reset on success."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.delay = 0.0
        self.next_t = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.next_t

    def failed(self, now: float) -> float:
        self.delay = self.first_s if self.delay == 0 else min(self.max_s, self.delay * 2)
        self.next_t = now + self.delay
        return self.delay

    def ok(self) -> None:
        self.delay, self.next_t = 0.0, 0.0


class GuardedStageDir(StageDir):
    """A stage dir whose unreadable ``attempt.json`` is read as the attempt the supervisor last knew."""

    def __init__(self, path: Path, stage_id: str, fallback: Callable[[str, Exception], int]) -> None:
        super().__init__(path, stage_id)
        self._fallback = fallback

    def attempt(self) -> int:
        try:
            n = super().attempt()
        except (ValueError, TypeError, AttributeError) as exc:
            return self._fallback(self.id, exc)
        return n if n >= 1 else self._fallback(self.id, ValueError(f"attempt {n} < 1"))


class GuardedRunDir(RunDir):
    """A run dir whose stage dirs are :class:`GuardedStageDir` (the supervisor's view of it)."""

    def __init__(self, root: Path, fallback: Callable[[str, Exception], int]) -> None:
        super().__init__(root)
        self._fallback = fallback

    def stage(self, stage_id: str) -> StageDir:
        sd = super().stage(stage_id)
        return GuardedStageDir(sd.path, sd.id, self._fallback)


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def describe_os_error(exc: OSError, root: Path) -> str:
    """``EROFS Read-only file system``; a full disk names its device (:func:`nospace.describe`)."""
    if nospace.is_nospace(exc):
        return nospace.describe(root)
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{name} {exc.strerror or exc}".strip()


def rel(path: Path | str | None, root: Path) -> str:
    if path is None:
        return str(root)
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


def _record_problem(name: str, rec: Any) -> str | None:
    if rec is None:
        return None
    if not isinstance(rec, dict):
        return f"is not a JSON object ({type(rec).__name__})"
    if name == "pause":
        return None
    a = rec.get("attempt")
    if not isinstance(a, int) or isinstance(a, bool) or a < 1:
        return f"has no whole attempt number (attempt = {a!r})"
    if name == "proc.json":
        for k in ("pid", "pgid", "start_time"):
            if not isinstance(rec.get(k), int):
                return f"has no whole {k} ({k} = {rec.get(k)!r})"
    if "t" in rec and not isinstance(rec["t"], int | float):
        return f"has a time that is not a number (t = {rec['t']!r})"
    return None


def stage_file_problem(stage_dir: Path, exc: BaseException | None = None) -> tuple[Path, str] | None:
    """Which of a stage's records is bad and how: the one ``exc`` names, else the first that fails a check.
    ``None`` when every record reads well (the error was not a file's)."""
    if isinstance(exc, CorruptFileError):
        return exc.path, f"is not valid JSON ({exc.detail})"
    for name in STAGE_RECORDS:
        p = stage_dir / name
        try:
            rec = read_json(p)
        except CorruptFileError as e:
            return p, f"is not valid JSON ({e.detail})"
        except OSError as e:
            return p, f"cannot be read ({e.strerror or e})"
        why = _record_problem(name, rec)
        if why:
            return p, why
    return None
