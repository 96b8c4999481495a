"""Is the run's supervisor alive? What the console and headless mode say about it, and when they restart it.

The supervisor rewrites ``state.json`` at least every 5 s, its ``supervisor.t`` moving each time. The watch
notes, on this machine's clock, when that value last moved (a host whose clock differs does not matter).
Once it has not moved for :data:`STALE_S`, it asks the executing host through the transport, every
:data:`CHECK_EVERY_S` while the silence lasts: ``ctl ensure --json`` starts a supervisor when none holds the
run's lock (a silent one that holds it is left alone: starting another would make two), and a read-only
watcher asks ``ctl liveness``, which starts nothing. The host's answer (``pipeline.run.supervise.liveness``: the lock,
the holder's pid, why the run directory cannot be written) is what the status line says:

* ``supervisor silent for 40s (pid 812 alive, cannot write: EROFS Read-only file system)``
* ``supervisor dead (last seen 10:01:02, 20s ago) — restarting it``
* ``supervisor dead (…) — read-only watcher, not restarting it; to start it: aerie attach /runs/x without --read-only …``
  (the run named as ``aerie attach`` takes it: its path here, or ``ssh://host/path``)

Widgets never talk to the host: the app (or headless mode) runs :meth:`SupervisorWatch.check` in a worker.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from console.transport import LocalTransport, Transport
from pipeline.run.projection.text import span

if TYPE_CHECKING:
    from console.model import RunModel

STALE_S = 12.0  # no new snapshot for this long (the supervisor writes one at least every 5 s): ask the host
CHECK_EVERY_S = 3.0  # while silent, ask again this often (and restart a dead supervisor again)


class SupervisorWatch:
    """Follows ``supervisor.t`` of the snapshots read and keeps the host's last liveness answer."""

    def __init__(self, read_only: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.read_only = read_only
        self.clock = clock
        self.seen_t: float | None = None
        self.moved_at = clock()  # attaching counts as a sign of life: a dead supervisor shows after STALE_S
        self.report: dict[str, Any] | None = None
        self.checking = False
        self.next_check = 0.0
        self.restarts = 0
        self.run = "RUN"  # the run as ``aerie attach`` takes it (a path, ssh://host/path): known once checked

    def observe(self, supervisor_t: float | None) -> None:
        """A snapshot was read; a moved ``t`` is a live supervisor (any old verdict is dropped)."""
        if supervisor_t is not None and supervisor_t != self.seen_t:
            self.seen_t, self.moved_at = supervisor_t, self.clock()
            self.report = None

    def silent_for(self) -> float:
        return self.clock() - self.moved_at

    def due(self, done: bool) -> bool:
        """Time to ask the host (and, unless read-only, restart a dead supervisor)."""
        return (
            not done and not self.checking and self.silent_for() > STALE_S and self.clock() >= self.next_check
        )

    async def check(self, transport: Transport) -> dict[str, Any]:
        """Ask the host: ``ctl ensure --json`` (restarts a dead supervisor) or, read-only, ``ctl liveness``."""
        self.checking = True
        self.run = run_address(transport)
        try:
            res = await transport.ctl(*(("liveness",) if self.read_only else ("ensure", "--json")))
            rep = _parse(res.returncode, res.stdout, res.message)
        except Exception as exc:  # the link dropped: the transport's own status says more
            rep = {"verdict": "unknown", "text": f"cannot ask the host about the supervisor: {exc}"}
        finally:
            self.checking = False
            self.next_check = self.clock() + CHECK_EVERY_S
        if rep.get("started"):
            self.restarts += 1
        self.report = rep
        return rep

    def line(self, done: bool) -> tuple[str, str] | None:
        """``(text, level)`` while the supervisor is not plainly alive (level: warning | error); else None."""
        if done or (self.silent_for() <= STALE_S and not _down(self.report)):
            return None  # (a host that said "dead" is said at once: a read-only watcher asks it on attach)
        rep = self.report
        if rep is None:
            return f"supervisor silent for {span(self.silent_for())} — checking…", "warning"
        verdict, text = rep.get("verdict"), str(rep.get("text", ""))
        if verdict == "running":
            return None
        if verdict == "silent":
            return text, "warning"
        if verdict in ("dead", "finished"):
            if self.read_only:
                return (
                    f"{text} — read-only watcher, not restarting it; to start it: aerie attach {self.run} "
                    "without --read-only (or any control action)",
                    "error",
                )
            return f"{text} — restarting it", "error"
        return text, "error"


def run_address(transport: Transport) -> str:
    """The run as ``aerie attach`` takes it: its directory here, or ``ssh://host/path`` on another host
    (quoted for a shell when it needs to be)."""
    where = (
        transport.run_root
        if isinstance(transport, LocalTransport)
        else f"ssh://{transport.status.host}{transport.run_root}"
    )
    return shlex.quote(where)


def _down(rep: dict[str, Any] | None) -> bool:
    return rep is not None and rep.get("verdict") == "dead"


def _parse(rc: int, stdout: str, message: str) -> dict[str, Any]:
    if rc == 0:
        try:
            rep = json.loads(stdout)
        except ValueError:
            rep = None
        if isinstance(rep, dict) and "verdict" in rep:
            return rep
        # a host whose ctl predates the liveness report: ensure printed one line
        return {"verdict": "unknown", "text": f"supervisor: {stdout.strip() or 'no answer'}"}
    return {"verdict": "unknown", "text": f"cannot check the supervisor: {message or f'exit {rc}'}"}


def open_alerts(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The supervisor's alerts that have not ended (state.json ``supervisor.alerts``)."""
    return [a for a in alerts if not a.get("resolved")]


def alerts_line(alerts: list[dict[str, Any]]) -> str | None:
    """``⚠ supervisor: <the latest open alert> (+N more)``, or None when there is none."""
    live = open_alerts(alerts)
    if not live:
        return None
    more = f" (+{len(live) - 1} more: aerie status)" if len(live) > 1 else ""
    return f"⚠ supervisor: {live[-1].get('text', '')}{more}"


async def rows_without_supervisor(model: RunModel, transport: Transport) -> bool:
    """No snapshot and no supervisor to write one (a read-only watcher starts none): every stage as its own
    files show it, from ``ctl status`` on the host — the rows ``aerie status`` prints
    (``pipeline.run.rundir.state_file.rows_from_files``); the supervisor's first snapshot replaces them. True
    when rows were shown."""
    try:
        res = await transport.ctl("status")
        state = json.loads(res.stdout) if res.returncode == 0 else None
    except Exception:  # noqa: BLE001 - the status line already says the supervisor is down
        return False
    if isinstance(state, dict) and state.get("stages") and not model.loaded:
        model.show_rows_from_files(state)
        return True
    return False
