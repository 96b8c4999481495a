"""The audit log screen (``A``): every control action on the run — when (UTC), who, from which front
end, what, on which stage, and the outcome — newest at the bottom, following new entries.

It reads ``RUN/audit.jsonl`` through :class:`console.audit_trail.AuditTrail` (the transport, never a
file or SSH itself), once a second while it is up. A line the log could not be read from (a torn last
line left by a crash) is named in the title, not shown as an entry.
"""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from console.audit_trail import AuditTrail
from pipeline.run.rundir.audit import AuditEntry

COLUMNS = ("Time (UTC)", "Who", "Via", "Action", "Stage", "Outcome")
OUTCOME_STYLE = {"done": "", "refused": "bold $warning", "timed out": "bold $error"}


class AuditScreen(Screen[None]):
    BINDINGS = [
        Binding("escape,A,q", "close", "Back", tooltip="back to the board"),
        Binding("f,end", "follow", "Follow", tooltip="the newest entry (the default: new entries scroll in)"),
        Binding("question_mark", "help", "Help", tooltip="every key of this screen"),
    ]
    DEFAULT_CSS = """
    AuditScreen #audit-title { height: auto; max-height: 4; background: $panel; color: $foreground; padding: 0 1; }
    AuditScreen DataTable { height: 1fr; }
    AuditScreen #audit-reason { height: auto; max-height: 4; padding: 0 1; border-top: solid $panel-lighten-2; }
    """

    def __init__(self, trail: AuditTrail, poll_s: float = 1.0) -> None:
        super().__init__()
        self.trail = trail
        self.poll_s = poll_s
        self._shown = 0  # entries in the table
        self._first: AuditEntry | None = None  # the table's first entry (the trail drops old ones)

    def compose(self) -> ComposeResult:
        yield Static("Audit log", id="audit-title")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="audit-table")
        yield Static("", id="audit-reason")  # the selected entry's whole outcome (the table cuts it with "…")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        table.focus()
        self.refresh_trail()
        self.set_interval(self.poll_s, self.refresh_trail)

    @work(exclusive=True, group="audit")
    async def refresh_trail(self) -> None:
        await self.trail.poll()
        self.sync()

    def _outcome(self, e: AuditEntry, width: int = 0) -> Text:
        """The outcome cell; past ``width`` cells cut with "…" (its whole text is under the table)."""
        text = _outcome_text(e)
        if width and cell_len(text) > width:
            text = set_cell_size(text, width - 1) + "…"
        style = OUTCOME_STYLE.get(e.outcome, "")
        if style:
            style = style.replace("$warning", self._var("warning")).replace("$error", self._var("error"))
        return Text(text, style=style)

    def _var(self, name: str) -> str:
        return self.app.get_css_variables().get(name, "")

    def sync(self) -> None:
        t = self.trail
        entries = list(t.entries)
        table = self.query_one(DataTable)
        if entries and (self._first is not entries[0] or self._shown > len(entries)):
            table.clear()  # the trail dropped its oldest entries (or was re-read): redraw
            self._shown = 0
        elif not entries and self._shown:
            table.clear()
            self._shown = 0
        self._first = entries[0] if entries else None
        follow = table.cursor_row >= self._shown - 1
        # The outcome column takes the width the others leave (each column pads 1 cell a side; a scrollbar 2).
        cols = (
            list(zip(*[(e.time_utc, e.who, e.via, e.what, e.stage) for e in entries], strict=True))
            or [()] * 5
        )
        used = sum(max([len(c), *map(len, vals)]) + 2 for c, vals in zip(COLUMNS[:-1], cols, strict=True))
        room = max(20, self.size.width - used - 4)
        for e in entries[self._shown :]:
            row = (f"{e.time_utc}", e.who, e.via, e.what, e.stage, self._outcome(e, room))
            table.add_row(*row, key=str(id(e)))
        if len(entries) > self._shown and follow:
            table.move_cursor(row=len(entries) - 1, animate=False)
        self._shown = len(entries)
        self._title()

    @on(DataTable.RowHighlighted)
    def _reason(self, event: DataTable.RowHighlighted) -> None:
        entries = list(self.trail.entries)
        e = next((e for e in entries if str(id(e)) == event.row_key.value), None)
        self.query_one("#audit-reason", Static).update(
            Text.assemble((f"{e.what} {e.stage}: ", "bold"), _outcome_text(e)) if e else ""
        )

    def _title(self) -> None:
        t = self.trail
        if not t.loaded:
            head = "reading the audit log…"
        elif not t.exists:
            head = "no control action yet (RUN/audit.jsonl does not exist)"
        else:
            refused = sum(1 for e in t.entries if e.outcome != "done")
            head = f"{len(t.entries)} entries · {refused} refused or timed out · RUN/audit.jsonl"
            if t.skipped_head:
                head += " (its last 256 KiB)"
        title = Text.assemble(("Audit log", "bold"), "  ", head)
        for problem in [*t.problems, *([t.torn] if t.torn else [])][-3:]:
            title.append(f"\n⚠ {problem}", style=self._var("warning"))
        self.query_one("#audit-title", Static).update(title)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_follow(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=table.row_count - 1, animate=False)

    def action_help(self) -> None:
        from console.screens.dialogs import HelpScreen, help_sections

        self.app.push_screen(HelpScreen(help_sections(self), title="Audit log — keys"))


def _outcome_text(e: AuditEntry) -> str:
    return e.outcome if e.outcome == "done" or not e.message else f"{e.outcome}: {e.message}"
