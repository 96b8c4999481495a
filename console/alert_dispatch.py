"""From the run's alert records to the operator: each alert raised on the executing host (the supervisor runs
every rule and the plan's hooks there, :mod:`pipeline.run.alerts`) is announced once by this console — a toast
carrying its evidence and naming its stage, the terminal bell — as the settings say. Every console reads the
same records (:class:`~console.alert_feed.AlertFeed`), so ``a`` lists the same alerts in each, whenever it
attached; only what is raised after this console attached is toasted (the list has the rest). A toast lasts
:data:`TOAST_S` seconds, over the detail pane (never the board's note column). No hook runs here: a hook is
run where the alert is raised (the plan's ``[alerts] command``) or by ``aerie watch`` (the user's own).
Never blocks the UI loop."""

from __future__ import annotations

from typing import Any, Protocol

from console.model import RunModel
from console.settings import Settings
from pipeline.run.alerts.record import AlertRecord


class AlertHost(Protocol):
    """What the dispatcher needs of the app (AerieApp): its settings, toasts and the bell."""

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


TOAST_S = 10  # an alert's toast: long enough to read its first lines; the list (``a``) keeps it all


class AlertDispatcher:
    def __init__(self, host: AlertHost) -> None:
        self.host = host
        self.seen: int | None = None  # the highest alert id announced or already there when attached
        self.announced = 0  # alerts toasted by this console (tests wait on it)
        self.last_stage: str | None = None  # the stage of the latest alert announced

    def check(self, model: RunModel) -> None:
        """Announce the records raised since the last check (none on the first: they were there already)."""
        feed = model.alerts
        if not feed.loaded:
            return
        top = max(feed.book, default=0)
        if self.seen is None:
            self.seen = top
            return
        for rid in sorted(i for i in feed.book if i > self.seen):
            self.announce(feed.book[rid])
        self.seen = max(self.seen, top)

    def announce(self, alert: AlertRecord) -> None:
        settings = self.host.settings
        self.announced += 1
        if alert.stage:
            self.last_stage = alert.stage
        if settings.notify:
            text = "\n".join((alert.text, *alert.evidence))
            if alert.stage:
                text += f"\n[a: alerts, Enter: go to {alert.stage}]"
            severity = "error" if alert.kind in ("stage-failed", "disk") else "warning"
            # No markup: evidence quotes log lines, whose "[...]" must show as printed.
            self.host.notify(text, title=alert.title, severity=severity, timeout=TOAST_S, markup=False)
        if settings.bell:
            self.host.bell()
