"""The alert list (``a``): the run's alert records (:mod:`pipeline.run.alerts.record`), open ones first, with
their evidence, hook deliveries and acknowledgement — the same list in every console, whenever it attached.

A toast lasts seconds and sits where it hides nothing the operator reads (see the app's CSS); this list is
where an alert stays: its time, title, text and the metric values or log lines that triggered it. Enter
(or a click) on one closes the list and selects its stage on the board. ``K`` acknowledges and ``S`` silences
the highlighted alert: the board's control actions (the app sends them, audited; a read-only console refuses
them), and the list shows who acknowledged it once the record says so (:meth:`AlertsScreen.sync`).
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from pipeline.run.alerts.record import AlertRecord


class AlertsScreen(ModalScreen[str | None]):
    """Dismisses with the chosen alert's stage id (None: closed, or an alert without a stage)."""

    BINDINGS = [
        Binding("escape,a,q", "close", "Close", tooltip="close the alert list"),
        Binding("enter", "go", "Go to stage", tooltip="select the highlighted alert's stage on the board"),
        Binding(
            "K",
            "ack_alert",
            "Ack",
            tooltip="acknowledge the highlighted alert: every console and aerie status show who and when",
        ),
        Binding(
            "S",
            "silence_alert",
            "Silence",
            tooltip="silence the highlighted alert: acknowledged, and no hook runs for later alerts of its kind "
            "on its stage",
        ),
    ]
    DEFAULT_CSS = """
    AlertsScreen { align: center middle; }
    AlertsScreen > Vertical { width: 90%; max-width: 140; height: 80%; border: thick $warning;
                              background: $surface; padding: 0 1; }
    AlertsScreen #alerts-title { height: 1; text-style: bold; }
    AlertsScreen OptionList { height: 1fr; border: none; }
    """

    def __init__(self, alerts: list[AlertRecord]) -> None:
        super().__init__()
        self.alerts = alerts  # open first, newest first (record.ordered)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self._title(self.alerts), id="alerts-title")
            yield OptionList(*(Option(self._entry(a), id=str(a.id)) for a in self.alerts))

    @staticmethod
    def _title(alerts: list[AlertRecord]) -> str:
        n, opened = len(alerts), sum(a.open for a in alerts)
        if not n:
            return "No alert in this run (failures, the disk, anomalies land here) · Esc: close"
        return (
            f"Alerts of this run: {opened} open, {n - opened} cleared (Enter: go to its stage · K: acknowledge · "
            "S: silence · Esc: close)"
        )

    @staticmethod
    def _entry(a: AlertRecord) -> Text:
        out = Text()
        out.append(f"#{a.id} " + time.strftime("%H:%M:%S ", time.localtime(a.raised_at)), style="dim")
        out.append(a.title, style="bold")
        state = (
            "open" if a.open else "cleared " + time.strftime("%H:%M:%S", time.localtime(a.cleared_at or 0))
        )
        if a.acked_by:
            state += f" · acknowledged by {a.acked_by}" + (" (silenced)" if a.silenced else "")
        out.append(f"  [{state}]", style="dim")
        out.append(f"\n  {a.text}")
        for line in a.evidence:
            out.append(f"\n  · {line}", style="dim")
        for d in a.hooks:
            rc = "timeout" if d.status == "timeout" else f"exit {d.rc}" if d.rc is not None else d.status
            out.append(f"\n  hook: {rc} at " + time.strftime("%H:%M:%S", time.localtime(d.t)), style="dim")
        return out

    def on_mount(self) -> None:
        if self.alerts:
            self.query_one(OptionList).highlighted = 0

    def sync(self, alerts: list[AlertRecord]) -> None:
        """The records changed (an alert raised, cleared, acknowledged): list them again, the same alert kept
        highlighted."""
        try:
            ol = self.query_one(OptionList)
        except NoMatches:  # a poll before the list was composed (or after it closed): compose lists these
            self.alerts = alerts
            return
        keep = self._highlighted()
        self.alerts = alerts
        self.query_one("#alerts-title", Static).update(self._title(alerts))
        ol.clear_options()
        ol.add_options([Option(self._entry(a), id=str(a.id)) for a in alerts])
        ids = [a.id for a in alerts]
        if ids:
            ol.highlighted = ids.index(keep.id) if keep is not None and keep.id in ids else 0

    def _highlighted(self) -> AlertRecord | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None or not self.alerts or ol.highlighted >= len(self.alerts):
            return None
        return self.alerts[ol.highlighted]

    def _stage(self) -> str | None:
        alert = self._highlighted()
        return alert.stage or None if alert is not None else None

    def _send(self, name: str) -> None:
        """``name`` (the action table's ``ack_alert`` / ``silence_alert``) for the highlighted alert, sent by
        the app as the board's key sends it (audited; refused by a read-only console)."""
        alert = self._highlighted()
        act = getattr(self.app, "act_on_alert", None)
        if alert is None:
            self.notify("no alert in this run to acknowledge", severity="information")
        elif act is not None:
            act(name, alert)

    def action_ack_alert(self) -> None:
        self._send("ack_alert")

    def action_silence_alert(self) -> None:
        self._send("silence_alert")

    def on_option_list_option_selected(self, _event: OptionList.OptionSelected) -> None:
        self.dismiss(self._stage())

    def action_go(self) -> None:
        self.dismiss(self._stage())

    def action_close(self) -> None:
        self.dismiss(None)
