"""The alert list (``a``): the run's alert records (:mod:`pipeline.run.alerts.record`), open ones first, with
their evidence, hook deliveries and acknowledgement — the same list in every console, whenever it attached.

A toast lasts seconds and sits where it hides nothing the operator reads (see the app's CSS); this list is
where an alert stays: its time, title, text and the metric values or log lines that triggered it. Enter
(or a click) on one closes the list and selects its stage on the board.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from pipeline.run.alerts.record import AlertRecord


class AlertsScreen(ModalScreen[str | None]):
    """Dismisses with the chosen alert's stage id (None: closed, or an alert without a stage)."""

    BINDINGS = [
        Binding("escape,a,q", "close", "Close", tooltip="close the alert list"),
        Binding("enter", "go", "Go to stage", tooltip="select the highlighted alert's stage on the board"),
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
            n, opened = len(self.alerts), sum(a.open for a in self.alerts)
            yield Static(
                f"Alerts of this run: {opened} open, {n - opened} cleared (Enter: go to its stage · Esc: close)"
                if n
                else "No alert in this run (failures, the disk, anomalies land here) · Esc: close",
                id="alerts-title",
            )
            yield OptionList(*(Option(self._entry(a), id=str(a.id)) for a in self.alerts))

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

    def _stage(self) -> str | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None or not self.alerts:
            return None
        return self.alerts[ol.highlighted].stage or None

    def on_option_list_option_selected(self, _event: OptionList.OptionSelected) -> None:
        self.dismiss(self._stage())

    def action_go(self) -> None:
        self.dismiss(self._stage())

    def action_close(self) -> None:
        self.dismiss(None)
