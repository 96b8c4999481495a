"""Running an alert's hook: ``[alerts] command`` (a shell command, e.g. ``curl`` to the team's webhook) with the
alert in ``AERIE_ALERT_*`` environment variables (never spliced into the command line; the evidence lines,
newline-separated, in ``AERIE_ALERT_EVIDENCE``), in a session of its own, bounded by ``timeout_s`` after which
its whole process group is SIGKILLed (a hanging ``curl`` and whatever else it started).

On the executing host the supervisor never waits for a hook: :class:`HookSpawner` starts one
``python -m pipeline.run.alerts.deliver`` child per alert (:mod:`pipeline.run.alerts.deliver`, which runs the
hook and records how it went in the alert's record) and reaps it with a non-blocking ``poll`` each cycle.
``aerie watch`` runs the user's own hooks with :func:`run_hook` in a thread. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from pipeline.run.alerts.record import AlertRecord
from pipeline.run.hosts.procs import env_with_pipeline

OUTPUT_TAIL = 400  # characters of a hook's output kept in its delivery record


@dataclass(frozen=True)
class HookResult:
    rc: int | None  # None: killed at its timeout
    output: str
    duration_s: float


def hook_env(rec: AlertRecord, run: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The hook's environment: the caller's, with the alert in ``AERIE_ALERT_*``."""
    return dict(
        os.environ if base is None else base,
        AERIE_ALERT_ID=str(rec.id),
        AERIE_ALERT_KIND=rec.kind,
        AERIE_ALERT_KEY=rec.key,
        AERIE_ALERT_TITLE=rec.title,
        AERIE_ALERT_TEXT=rec.text,
        AERIE_ALERT_STAGE=rec.stage,
        AERIE_ALERT_ATTEMPT=str(rec.attempt),
        AERIE_ALERT_RUN=run,
        AERIE_ALERT_RAISED_AT=f"{rec.raised_at:.3f}",
        AERIE_ALERT_EVIDENCE="\n".join(rec.evidence),
    )


def run_hook(command: str, env: dict[str, str], timeout_s: float, cwd: str | None = None) -> HookResult:
    """Run ``command`` with ``/bin/sh -c`` in its own session; blocks until it ends or ``timeout_s`` passed
    (then its process group is killed). Returns its exit code (None on timeout) and the tail of its output."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["/bin/sh", "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
        text = out.decode(errors="replace").strip()[-OUTPUT_TAIL:]
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the hook's own session: it and its children only
        proc.communicate()
        rc, text = None, f"no answer within {timeout_s:g}s (killed)"
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return HookResult(rc, text, round(time.monotonic() - t0, 3))


class HookSpawner:
    """The supervisor's side: one detached deliverer per alert, reaped without waiting."""

    def __init__(self, run_root: str, command: str, timeout_s: float, python: str = sys.executable) -> None:
        self.run_root, self.command, self.timeout_s, self.python = run_root, command, timeout_s, python
        self.children: list[subprocess.Popen[bytes]] = []

    def spawn(self, alert_id: int) -> None:
        child = subprocess.Popen(
            [
                self.python,
                "-m",
                "pipeline.run.alerts.deliver",
                self.run_root,
                str(alert_id),
                f"{self.timeout_s:g}",
                self.command,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a hook is never in the supervisor's process group
            cwd=self.run_root,
            env=env_with_pipeline(),
        )
        self.children.append(child)

    def reap(self) -> int:
        """Collect the deliverers that ended (``poll``: never blocks); how many still run."""
        self.children = [c for c in self.children if c.poll() is None]
        return len(self.children)

    def drain(self, wait_s: float) -> None:
        """Before the supervisor exits: give running deliverers up to ``wait_s`` to finish (they record their
        own outcome either way; they are not killed)."""
        deadline = time.monotonic() + wait_s
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.05)
