"""Modal dialogs: the confirmation asked before any destructive action, and the help screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no. Dismisses with True only on an explicit yes (`y` or the button)."""

    BINDINGS = [Binding("y", "yes", "Yes"), Binding("n,escape", "no", "No")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Grid { grid-size: 2; grid-gutter: 1 2; grid-rows: auto 3; padding: 1 2; width: 72;
                           height: auto; border: thick $error; background: $surface; }
    ConfirmScreen #question { column-span: 2; width: 100%; }
    ConfirmScreen Button { width: 100%; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question, id="question")
            yield Button("Yes (y)", variant="error", id="yes")
            yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class HelpScreen(ModalScreen[None]):
    """Every key of the current screen, with what it does."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 80; height: auto; max-height: 90%; border: thick $primary;
                                  background: $surface; padding: 1 2; }
    """

    def __init__(self, rows: list[tuple[str, str]], notes: str = "") -> None:
        super().__init__()
        self.rows = rows
        self.notes = notes

    def compose(self) -> ComposeResult:
        width = max((len(k) for k, _ in self.rows), default=4) + 2
        body = "\n".join(f"[b]{k:<{width}}[/b]{d}" for k, d in self.rows)
        with VerticalScroll():
            yield Static("[b]Aerie — keys[/b]\n\n" + body + ("\n\n" + self.notes if self.notes else ""))

    def action_close(self) -> None:
        self.dismiss(None)
