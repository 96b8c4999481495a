"""The alert list (``a``): every alert this console announced, newest first, with its evidence.

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

from console.alerts import Alert


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

    def __init__(self, alerts: list[tuple[float, Alert]]) -> None:
        super().__init__()
        self.alerts = list(reversed(alerts))  # newest first

    def compose(self) -> ComposeResult:
        with Vertical():
            n = len(self.alerts)
            yield Static(
                f"Alerts of this console: {n} (Enter: go to its stage · Esc: close)"
                if n
                else "No alert yet in this console (failures, the disk, anomalies land here) · Esc: close",
                id="alerts-title",
            )
            yield OptionList(*(Option(self._entry(t, a), id=str(i)) for i, (t, a) in enumerate(self.alerts)))

    @staticmethod
    def _entry(t: float, a: Alert) -> Text:
        out = Text()
        out.append(time.strftime("%H:%M:%S ", time.localtime(t)), style="dim")
        out.append(a.title, style="bold")
        out.append(f"\n  {a.text}")
        for line in a.evidence:
            out.append(f"\n  · {line}", style="dim")
        return out

    def on_mount(self) -> None:
        if self.alerts:
            self.query_one(OptionList).highlighted = 0

    def _stage(self) -> str | None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None or not self.alerts:
            return None
        return self.alerts[ol.highlighted][1].stage or None

    def on_option_list_option_selected(self, _event: OptionList.OptionSelected) -> None:
        self.dismiss(self._stage())

    def action_go(self) -> None:
        self.dismiss(self._stage())

    def action_close(self) -> None:
        self.dismiss(None)
