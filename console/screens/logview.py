"""The full-log screen for one stage: the log's last part, followed live (bounded, batched)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Log, Static


class LogScreen(Screen[None]):
    BINDINGS = [
        Binding("escape,q", "close", "Back"),
        Binding("end,f", "follow", "Follow"),
        Binding("home,g", "top", "Top"),
    ]

    def __init__(self, stage_id: str, lines: list[str]) -> None:
        super().__init__()
        self.stage_id = stage_id
        self._initial = lines

    def compose(self) -> ComposeResult:
        yield Static(f"[b]{self.stage_id}[/b] — log (Esc to go back, End to follow)", id="log-title")
        yield Log(max_lines=20000, auto_scroll=True, id="full-log")
        yield Footer()

    def on_mount(self) -> None:
        log = self.query_one(Log)
        log.write_lines(self._initial)

    def append(self, lines: list[str]) -> None:
        if lines:
            self.query_one(Log).write_lines(lines)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_follow(self) -> None:
        log = self.query_one(Log)
        log.auto_scroll = True
        log.scroll_end(animate=False)

    def action_top(self) -> None:
        log = self.query_one(Log)
        log.auto_scroll = False
        log.scroll_home(animate=False)
