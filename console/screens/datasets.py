"""The dataset progress screen: the preps and regenerations as rows, sorted by state then ETA.

The app calls :meth:`DatasetsScreen.sync` with the model after each poll while the screen is up;
the table is rebuilt only when a row's text changed. ``l``/``Enter`` opens the selected stage's
log; the board's actions (pause, kill, retry...) act on the selected row here too.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from console import fmt
from console.datasets import DatasetRow, dataset_rows
from console.model import RunModel
from pipeline.run.rundir.stage_row import StageState

COLUMNS = ("Dataset", "Stage", "State", "Done / quota", "Progress", "Rate", "ETA", "Rejects", "Note")


class DatasetsScreen(Screen[None]):
    BINDINGS = [
        Binding("escape,d", "close", "Back", tooltip="back to the board"),
        Binding("l,enter", "log", "Log", tooltip="the selected stage's full log"),
        Binding("question_mark", "help", "Help", tooltip="every key of this screen"),
    ]
    DEFAULT_CSS = """
    DatasetsScreen #ds-title { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    DatasetsScreen DataTable { height: 1fr; }
    """

    def __init__(self, model: RunModel) -> None:
        super().__init__()
        self.model = model
        self._sig: tuple = ()
        self._keys: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="ds-title")
        table: DataTable = DataTable(cursor_type="row", zebra_stripes=True, id="ds-table")
        # The columns exist before the screen mounts: the app's poll can sync a screen it has just pushed
        # before its on_mount runs (rows then met a table without columns: "More values than columns").
        table.add_columns(*COLUMNS)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.focus()
        self.sync(self.model)

    @property
    def selected_stage_id(self) -> str | None:
        table = self.query_one(DataTable)
        if not self._keys:
            return None
        return self._keys[min(table.cursor_row, len(self._keys) - 1)]

    def _style(self, state: str) -> str:
        style_of = getattr(self.app, "state_style", None)
        return style_of(state) if style_of else ""

    def _cells(self, r: DatasetRow) -> tuple:
        done = (
            f"{fmt.count(r.done)} / {fmt.count(r.total)} {r.unit}"
            if r.total
            else (fmt.count(r.done) if r.done else "")
        )
        frac = r.fraction
        return (
            r.dataset,
            r.family,
            Text(r.state, style=self._style(r.state)),
            done,
            f"{fmt.bar(frac, 10)} {frac * 100:3.0f}%" if frac is not None else "",
            fmt.rate(r.rate, r.unit) if r.rate is not None else "",
            fmt.duration(r.eta_s) if r.eta_s else "",
            str(r.rejects) if r.rejects else "",
            r.note,
        )

    def sync(self, model: RunModel) -> None:
        rows = dataset_rows(model)
        cells = [self._cells(r) for r in rows]
        sig = tuple(
            (r.stage, tuple(str(c) for c in cs), str(cs[2].style)) for r, cs in zip(rows, cells, strict=True)
        )
        n_running = sum(1 for r in rows if r.state == StageState.RUNNING)
        title = Text.assemble(
            ("Datasets", "bold"), f"  {len(rows)} stages · {n_running} running · sorted by state, then ETA"
        )
        self.query_one("#ds-title", Static).update(title)
        if sig == self._sig:
            return
        self._sig = sig
        table = self.query_one(DataTable)
        selected = self.selected_stage_id
        table.clear()
        self._keys = [r.stage for r in rows]
        for r, cs in zip(rows, cells, strict=True):
            table.add_row(*cs, key=r.stage)
        if selected in self._keys:
            table.move_cursor(row=self._keys.index(selected), animate=False)
        if not rows:
            self.query_one("#ds-title", Static).update("No stage in this plan works on a dataset.")

    def action_close(self) -> None:
        self.dismiss(None)

    def action_log(self) -> None:
        sid = self.selected_stage_id
        if sid is not None and hasattr(self.app, "open_log"):
            self.app.open_log(sid)

    def action_help(self) -> None:
        from console.screens.dialogs import HelpScreen, help_sections

        self.app.push_screen(HelpScreen(help_sections(self), title="Datasets — keys"))
