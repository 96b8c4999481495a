"""Alerts: a stage failing, the disk projection turning red, or an anomaly, announced once per event.

:class:`AlertWatcher` looks at the run model after each poll and proposes alerts for what is new
*to this console* (pure, in memory, cheap). :class:`AlertBook` is a small JSON file in the user's
state directory (``settings.state_dir()/alerts.json``) recording which events were announced,
keyed by the run (host and run directory) and the event — ``failed:<stage>:<attempt>`` for a
failure, the disk level for the disk — so re-attaching, a second console on the same run, or the
browser mode never announce an event twice; the claim is made under an exclusive ``flock``.
The disk alert re-arms once the projection is back to fitting. Anomalies (a stalled stage, a NaN loss ...)
are found by :mod:`console.anomalies` and come here as :class:`Alert` objects with their evidence.

:func:`run_hook` runs an ``[alerts] command`` (e.g. ``curl`` to a webhook) in its own session with
the event in ``AERIE_ALERT_*`` environment variables (never spliced into the command line; the evidence
lines, newline-separated, in ``AERIE_ALERT_EVIDENCE``), bounded
by a timeout after which its process group is killed; under ``console/hook_guard.py`` it also dies with
the console, however the console ends. The console calls all of this from workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from console.model import RunModel
from pipeline.run.rundir.layout import write_atomic
from pipeline.run.rundir.stage_row import StageState

DISK_RANK = {"ok": 0, "warning": 1, "error": 2}
MAX_RUNS = 200
MAX_KEYS_PER_RUN = 2000


@dataclass(frozen=True)
class Alert:
    key: str  # failed:<stage>:<attempt> | disk:<level> | <anomaly kind>:<stage>:<attempt>:<episode>
    kind: str  # stage-failed | disk | an anomaly kind (console/anomalies.py)
    title: str
    text: str
    stage: str = ""
    attempt: int = 0
    evidence: tuple[str, ...] = ()  # the metric values / log lines that triggered it


class AlertWatcher:
    """Proposes the alerts the model shows that this console has not looked at yet."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.disk_level = "ok"

    def check(self, model: RunModel) -> tuple[list[Alert], str | None]:
        """(new failure alerts, the disk level if it changed since the last check)."""
        out = []
        for st in model.stages.values():
            if st.state != StageState.FAILED:
                continue
            key = f"failed:{st.id}:{st.attempt}"
            if key in self.seen:
                continue
            self.seen.add(key)
            why = st.reason or (f"exit {st.returncode}" if st.returncode is not None else "failed")
            out.append(
                Alert(
                    key,
                    "stage-failed",
                    f"{st.id} failed",
                    f"{st.id} attempt {st.attempt} failed: {why}",
                    st.id,
                    st.attempt,
                )
            )
        disk = model.telemetry.disk
        level = disk.status()[1] if disk is not None and disk.avail is not None else "ok"
        changed = None
        if level != self.disk_level:
            self.disk_level = changed = level
        return out, changed

    @staticmethod
    def disk_alert(model: RunModel, level: str) -> Alert:
        disk = model.telemetry.disk
        text = disk.status()[0] if disk is not None else "disk"
        title = "disk below the reserve" if level == "error" else "disk projection does not fit"
        return Alert(f"disk:{level}", "disk", title, f"{model.run_name or model.run_dir}: {text}")


class AlertBook:
    """Which events were announced, per run, in one small locked JSON file."""

    def __init__(self, path: Path, run_key: str) -> None:
        self.path = Path(path)
        self.run_key = run_key

    def claim(self, keys: list[str], disk_level: str | None = None) -> tuple[list[str], bool]:
        """Record ``keys`` and the disk level; returns the keys not announced before and whether
        the disk level is worse than the one last announced (both now belong to the caller)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                book = json.loads(self.path.read_text())
                if not isinstance(book, dict) or not isinstance(book.get("runs"), dict):
                    book = {"runs": {}}
            except (FileNotFoundError, ValueError):
                book = {"runs": {}}
            runs = book["runs"]
            run = runs.setdefault(self.run_key, {"fired": {}, "disk": "ok"})
            now = round(time.time(), 3)
            fired = run.setdefault("fired", {})
            new = [k for k in keys if k not in fired]
            for k in new:
                fired[k] = now
            disk_fire = False
            if disk_level is not None:
                prev = run.get("disk", "ok")
                disk_fire = DISK_RANK.get(disk_level, 0) > DISK_RANK.get(prev, 0)
                run["disk"] = disk_level
            run["t"] = now
            if len(fired) > MAX_KEYS_PER_RUN:
                run["fired"] = dict(sorted(fired.items(), key=lambda kv: kv[1])[-MAX_KEYS_PER_RUN:])
            if len(runs) > MAX_RUNS:
                keep = sorted(runs.items(), key=lambda kv: kv[1].get("t", 0))[-MAX_RUNS:]
                book["runs"] = dict(keep)
            if new or disk_level is not None:
                write_atomic(self.path, json.dumps(book, indent=1, sort_keys=True) + "\n")
            return new, disk_fire


async def run_hook(command: str, alert: Alert, run: str, timeout_s: float) -> tuple[int | None, str]:
    """Run one hook for ``alert``; (exit code or None on timeout, the tail of its output)."""
    env = dict(
        os.environ,
        AERIE_ALERT_KIND=alert.kind,
        AERIE_ALERT_KEY=alert.key,
        AERIE_ALERT_TITLE=alert.title,
        AERIE_ALERT_TEXT=alert.text,
        AERIE_ALERT_STAGE=alert.stage,
        AERIE_ALERT_ATTEMPT=str(alert.attempt),
        AERIE_ALERT_RUN=run,
        AERIE_ALERT_EVIDENCE="\n".join(alert.evidence),
    )
    # Through the guard (console/hook_guard.py), leader of the hook's own session: the hook dies with this
    # console however it ends (SIGKILL included), and is killed whole when it times out or the console closes.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("hook_guard.py")),
        str(os.getpid()),
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the hook's own session: it and its children only
        await proc.wait()
        return None, f"no answer within {timeout_s:g}s (killed)"
    except BaseException:  # cancelled: the console is closing; the hook goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out.decode(errors="replace").strip()[-400:]
