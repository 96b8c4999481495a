"""Modal dialogs: the confirmation asked before any destructive action, a one-line prompt, and the help screen.

The help screen is generated from the bindings active on the screen it was opened from (the
screen's, its focused widget's and the app's), so it lists every key there is, with the long
description each binding carries in its ``tooltip``, grouped (navigate / find / control / views);
bindings without a ``tooltip`` are the framework's and are left out.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Input, Label, Static

from console.actions import CONTROL_NAMES


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


class PromptScreen(ModalScreen[str | None]):
    """One line of text: Enter gives it (possibly empty), Esc gives None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    PromptScreen { align: center middle; }
    PromptScreen > Grid { grid-size: 1; grid-rows: auto 3; padding: 1 2; width: 80; max-width: 100%;
                          height: auto; border: thick $primary; background: $surface; }
    """

    def __init__(self, question: str, placeholder: str = "") -> None:
        super().__init__()
        self.question = question
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question)
            yield Input(placeholder=self.placeholder, id="answer")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


# Help groups, in the order shown; an action not named here goes under "Views".
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "Navigate": (
        "cursor",
        "cursor_to",
        "scroll_lines",
        "scroll_cols",
        "top",
        "follow",
        "screen.top",
        "screen.follow",
        "back",
        "close",
        "clear_filter",
        "previous_stage",
        "next_stage",
        "scroll_up",
        "scroll_down",
        "page_up",
        "page_down",
        "scroll_home",
        "scroll_end",
        "app.focus_board",
    ),
    "Find": ("filter", "search", "next", "previous", "first_error"),
    "Control the selected stage": (*CONTROL_NAMES, "read_only"),  # the action table's control actions
    "Views": (),
}
FRAMEWORK_ACTIONS = (
    "quit",
    "command_palette",
)  # Textual's Ctrl+Q (`q` is ours) and its palette row (ours below)
KEY_WORDS = {
    "⏎": "Enter",
    "pgup": "PgUp",
    "pgdn": "PgDn",
    "home": "Home",
    "end": "End",
    "esc": "Esc",
    "space": "Space",
    "enter": "Enter",
    "tab": "Tab",
}


def key_label(app: App, key: str) -> str:
    """A key as an operator reads it: ``PgUp``, ``Esc``, ``Ctrl+P``, ``?`` (not ``pgup`` or ``^p``)."""
    label = app.get_key_display(Binding(key, "x"))
    if label.startswith("^") and len(label) > 1:
        rest = label[1:]
        return "Ctrl+" + KEY_WORDS.get(rest, rest.upper() if len(rest) == 1 else rest)
    return KEY_WORDS.get(label, label)


def _group(action: str) -> str:
    name = action.split("(")[0]
    return next((g for g, names in HELP_GROUPS.items() if name in names), "Views")


def help_sections(screen: Screen) -> list[tuple[str, list[tuple[str, str]]]]:
    """(group, [(keys, what they do)]) for the keys active on ``screen``, in operator words.

    Only bindings that carry a description for the operator (``tooltip``) are listed: the
    framework's own (focus cycling, copy, page left...) are not keys of Aerie. Keys that do the
    same thing share a row (``↑ / ↓``).
    """
    app = screen.app
    own = {
        k.strip(): b
        for b in getattr(screen, "BINDINGS", [])
        if isinstance(b, Binding)
        for k in b.key.split(",")
    }
    rows: dict[str, tuple[str, list[str]]] = {}
    for key, active in screen.active_bindings.items():
        b = active.binding
        if not b.tooltip and key in own:  # a focused table's Enter does what the screen says it does
            b = own[key]
        if not b.tooltip or b.system or b.action in FRAMEWORK_ACTIONS:
            continue
        group, keys = rows.setdefault(b.tooltip, (_group(b.action), []))
        label = key_label(app, key)
        if label not in keys:
            keys.append(label)
    if app.ENABLE_COMMAND_PALETTE:
        rows.setdefault(
            "command palette: every action, and the themes",
            ("Views", [key_label(app, app.COMMAND_PALETTE_BINDING)]),
        )
    out: dict[str, list[tuple[str, str]]] = {g: [] for g in HELP_GROUPS}
    for what, (group, keys) in rows.items():
        out[group].append((" / ".join(keys), what))
    return [(g, r) for g, r in out.items() if r]


def binding_rows(app: App, bindings: list[Binding]) -> list[tuple[str, str]]:
    """(keys, what they do) of a widget's own bindings that carry help (a pane that is not focused now)."""
    rows: dict[str, list[str]] = {}
    for b in bindings:
        if b.tooltip:
            keys = rows.setdefault(b.tooltip, [])
            for k in b.key.split(","):
                if key_label(app, k.strip()) not in keys:
                    keys.append(key_label(app, k.strip()))
    return [(" / ".join(keys), what) for what, keys in rows.items()]


class HelpScreen(ModalScreen[None]):
    """The keys of the screen it was opened from, grouped, with what they do."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 100; max-width: 96%; height: auto; max-height: 90%;
                                  border: thick $primary; background: $surface; padding: 1 2; }
    """

    def __init__(
        self, sections: list[tuple[str, list[tuple[str, str]]]], notes: str = "", title: str = "Aerie — keys"
    ) -> None:
        super().__init__()
        self.sections = sections
        self.notes = notes
        self.title_text = title

    def compose(self) -> ComposeResult:
        width = max((len(k) for _g, rows in self.sections for k, _ in rows), default=4)
        parts: list[RenderableType] = [Text(self.title_text, style="bold")]
        for group, rows in self.sections:
            parts.append(Text("\n" + group, style="bold"))
            table = Table(box=None, show_header=False, padding=(0, 1), expand=True)
            table.add_column(
                no_wrap=True, width=width + 2, style="bold"
            )  # keys; a long description wraps beside them
            table.add_column(ratio=1)
            for k, d in rows:
                table.add_row(f" {k}", d)
            parts.append(table)
        if self.notes:
            parts.append(Text("\n" + self.notes))
        with VerticalScroll(id="help-scroll"):
            yield Static(Group(*parts), id="help-body")

    def on_mount(self) -> None:
        scroll = self.query_one("#help-scroll", VerticalScroll)
        scroll.focus()
        self.watch(scroll, "scroll_y", lambda _y: self._scroll_mark(), init=False)
        self.call_after_refresh(self._scroll_mark)

    def on_resize(self) -> None:
        self.call_after_refresh(self._scroll_mark)

    def _scroll_mark(self) -> None:
        """Say in the frame's bottom edge that the sheet goes on (a scrollbar alone is a colour, easy to miss)."""
        scroll = self.query_one("#help-scroll", VerticalScroll)
        below = int(scroll.max_scroll_y - scroll.scroll_y)
        above = int(scroll.scroll_y)
        if below > 0:
            scroll.border_subtitle = f"▼ {below} more line{'s' if below != 1 else ''} below: ↓ / PgDn"
        elif above > 0:
            scroll.border_subtitle = f"▲ {above} more line{'s' if above != 1 else ''} above: ↑ / PgUp"
        else:
            scroll.border_subtitle = ""

    @property
    def text(self) -> str:
        """The help as plain text (what the operator reads): group titles, then ``keys  what`` rows."""
        out = []
        for group, rows in self.sections:
            out.append(f"[{group}]")
            out += [f"{k}  {d}" for k, d in rows]
        return "\n".join(out) + "\n" + self.notes

    def action_close(self) -> None:
        self.dismiss(None)
