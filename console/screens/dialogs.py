"""Modal dialogs: the confirmation asked before any destructive action, and the help screen.

The help screen is generated from the bindings active on the screen it was opened from (the
screen's, its focused widget's and the app's), so it lists every key there is, with the long
description each binding carries in its ``tooltip``.
"""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import ModalScreen, Screen
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


def help_rows(screen: Screen) -> list[tuple[str, str]]:
    """(keys, what they do) for every binding active on ``screen``; keys of one action share a row."""
    app = screen.app
    rows: dict[tuple[str, str], list[str]] = {}
    for active in screen.active_bindings.values():
        b = active.binding
        if b.system and not b.description:
            continue
        what = b.tooltip or b.description or b.action.replace("_", " ")
        keys = rows.setdefault((b.action, what), [])
        label = app.get_key_display(b)
        if label not in keys:
            keys.append(label)
    out = [(" / ".join(keys), what) for (_action, what), keys in rows.items()]
    if app.ENABLE_COMMAND_PALETTE and not any("palette" in what for _, what in out):
        out.append((app.get_key_display(Binding(app.COMMAND_PALETTE_BINDING, "command_palette")),
                    "command palette: every action, themes"))
    return out


class HelpScreen(ModalScreen[None]):
    """Every key of the screen it was opened from, with what it does."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; height: auto; max-height: 90%; border: thick $primary;
                                  background: $surface; padding: 1 2; }
    """

    def __init__(self, rows: list[tuple[str, str]], notes: str = "", title: str = "Aerie — keys") -> None:
        super().__init__()
        self.rows = rows
        self.notes = notes
        self.title_text = title

    def compose(self) -> ComposeResult:
        width = max((len(k) for k, _ in self.rows), default=4) + 2
        body = "\n".join(f"[b]{escape(k):<{width}}[/b]{escape(d)}" for k, d in self.rows)
        with VerticalScroll():
            yield Static(f"[b]{escape(self.title_text)}[/b]\n\n" + body
                         + ("\n\n" + escape(self.notes) if self.notes else ""), id="help-body")

    @property
    def text(self) -> str:
        """The help as plain text (what the operator reads)."""
        return "\n".join(f"{k}  {d}" for k, d in self.rows) + "\n" + self.notes

    def action_close(self) -> None:
        self.dismiss(None)
