"""From the model to the operator: new failures, disk projections and anomalies (:mod:`console.anomalies`)
become alerts, each claimed once across consoles (:class:`~console.alerts.AlertBook`), then announced — a toast,
the terminal bell, the hook commands — as the settings say. An anomaly's toast carries its evidence and names
its stage; ``a`` on the board lists every alert announced (:attr:`AlertDispatcher.history`; Enter selects the
alert's stage), and the hook gets it in ``AERIE_ALERT_STAGE``. A toast lasts :data:`TOAST_S` seconds, over the
detail pane (never the board's note column): the list keeps it. Runs in workers of the app; never blocks the
UI loop."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Protocol

from console.alerts import Alert, AlertBook, AlertWatcher, run_hook
from console.anomalies import AnomalyWatcher
from console.model import RunModel
from console.settings import Settings


class AlertHost(Protocol):
    """What the dispatcher needs of the app (AerieApp): its settings, toasts, the bell and its workers."""

    settings: Settings

    def notify(
        self,
        message: str,
        *,
        title: str = ...,
        severity: Any = ...,
        timeout: float | None = ...,
        markup: bool = ...,
    ) -> None: ...

    def bell(self) -> None: ...

    def run_worker(self, work: Any, *, group: str = ...) -> Any: ...


TOAST_S = 10  # an alert's toast: long enough to read its first lines; the list (``a``) keeps it all
HISTORY = 200  # alerts the list keeps


class AlertDispatcher:
    def __init__(self, host: AlertHost, book: AlertBook, where: str) -> None:
        self.host, self.book, self.where = host, book, where
        self.watcher = AlertWatcher()
        self.anomalies = AnomalyWatcher(host.settings.rules)
        self.hooks_run = 0  # hook commands completed (tests wait on it)
        self.last_stage: str | None = None  # the stage of the latest alert announced
        # (when, alert) of every alert announced: the list ``a`` shows
        self.history: deque[tuple[float, Alert]] = deque(maxlen=HISTORY)

    def attach(self, model: RunModel) -> None:
        """Let the anomaly rules see each event the model applies."""
        model.listeners.append(self.anomalies.on_event)

    def check(self, model: RunModel) -> None:
        fails, disk_level = self.watcher.check(model)
        self.anomalies.rules = self.host.settings.rules  # the plan's, once it has been read
        fails += self.anomalies.check(model)
        if fails or disk_level is not None:
            self.host.run_worker(self._fire(model, fails, disk_level), group="alerts")

    async def _fire(self, model: RunModel, fails: list[Alert], disk_level: str | None) -> None:
        try:
            new, disk_fire = await asyncio.to_thread(self.book.claim, [a.key for a in fails], disk_level)
        except OSError as exc:  # no state dir: announce anyway, once per session
            self.host.notify(f"cannot record alerts in {self.book.path}: {exc}", severity="warning")
            new, disk_fire = [a.key for a in fails], disk_level in ("warning", "error")
        todo = [a for a in fails if a.key in new]
        if disk_fire and disk_level is not None:
            todo.append(AlertWatcher.disk_alert(model, disk_level))
        for alert in todo:
            self.announce(alert)

    def announce(self, alert: Alert) -> None:
        settings = self.host.settings
        self.history.append((time.time(), alert))
        if alert.stage:
            self.last_stage = alert.stage
        if settings.notify:
            text = "\n".join((alert.text, *alert.evidence))
            if alert.evidence and alert.stage:
                text += f"\n[a: alerts, Enter: go to {alert.stage}]"
            severity = "error" if alert.kind in ("stage-failed", "disk") else "warning"
            # No markup: evidence quotes log lines, whose "[...]" must show as printed.
            self.host.notify(text, title=alert.title, severity=severity, timeout=TOAST_S, markup=False)
        if settings.bell:
            self.host.bell()
        for cmd in settings.hooks:
            self.host.run_worker(self._hook(cmd, alert), group="alert-hooks")

    async def _hook(self, command: str, alert: Alert) -> None:
        try:
            rc, out = await run_hook(command, alert, self.where, self.host.settings.hook_timeout_s)
        except OSError as exc:
            rc, out = 127, str(exc)
        self.hooks_run += 1
        if rc != 0:
            self.host.notify(
                f"alert hook `{command}` failed ({'timeout' if rc is None else f'exit {rc}'}): {out}",
                title="alert hook",
                severity="warning",
                timeout=10,
            )
