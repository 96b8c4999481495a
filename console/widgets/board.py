"""The stage board: the run's DAG as a table, one row per stage, families grouped as blocks.

Columns: stage, state, attempt, elapsed, progress bar, done/total, rate, ETA, note (why it waits,
health, accept length, why it failed...). Each column is as wide as its widest value; on a narrow
terminal the progress bar shrinks and whole columns drop (``DROP_ORDER``) so that no value is cut
and the note keeps room. A family with several members (the 10 preps) gets a header row with the
aggregate progress and state counts, then its members indented below it. State colours come from
the app's theme (``App.state_style``), never from this widget.

A family folds to its header row (``z`` on any of its rows, ``Z`` every family): its members that need the
operator (running, paused, failed, killed, unhealthy — :data:`console.states.ATTENTION`; a force armed, ⚑;
done having skipped all its work, with a warning whose ⚠ reason must show: ``board_cells.needs_a_look``)
stay listed under it, the rest hide. When the rows do not fit the board's room (:attr:`StageBoard.room`, set
by the app from the terminal height) families fold by themselves — first those with no member needing attention, then all — so at 80×24
the running and failed stages stay on screen, and the selected row is always scrolled into view. A family
the operator folded or unfolded keeps that choice; a filter shows every match, folded or not.

It renders through Textual's line API with one cached strip per row, so a board at rest costs
nothing and a tick repaints only the lines of the rows whose text changed (a DataTable re-renders
every cell of every row on any update: measured 3x the CPU, see docs/performance.md).

Over 450 lines: one widget whose rows, line rendering, folding and cursor share the row cache; what a cell
or a note says already lives in ``board_cells``.
"""

from __future__ import annotations

import time

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.events import Click, Resize
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from console import fmt
from console.model import RunModel, StageView
from console.states import FAMILY_PRECEDENCE
from console.widgets.board_cells import (
    BAR_NARROW,
    BAR_WIDE,
    Cell,
    _Bar,
    _bar,
    _fit,
    _plain_len,
    _Row,
    alerted_note,
    auto_folds,
    needs_a_look,
    note_for,
    server_line,
)
from pipeline.run.rundir.stage_row import StageState

__all__ = ["StageBoard", "note_for", "server_line"]

COLUMNS = ("Stage", "State", "Try", "Elapsed", "Progress", "Done", "Rate", "ETA", "Note")
# Every column but the note is as wide as its widest value (so no value is ever cut); when the note
# would get fewer than NOTE_MIN columns, the progress bar shrinks to BAR_NARROW cells and then whole
# columns go, in this order. The note, a sentence, is abbreviated with "…" at its end.
DROP_ORDER = ("Rate", "ETA", "Try", "Elapsed", "Done")
NOTE_MIN = 30
GROUP_PREFIX = "group:"


class StageBoard(ScrollView, can_focus=True):
    """The board. Call :meth:`sync` with the model after each poll."""

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False, tooltip="previous / next stage"),
        Binding("down", "cursor(1)", "Down", show=False, tooltip="previous / next stage"),
        Binding("pageup", "cursor(-10)", show=False, tooltip="ten stages up / down"),
        Binding("pagedown", "cursor(10)", show=False, tooltip="ten stages up / down"),
        Binding("home", "cursor_to(0)", show=False, tooltip="first / last stage"),
        Binding("end", "cursor_to(-1)", show=False, tooltip="first / last stage"),
        Binding(
            "z",
            "fold",
            "Fold",
            show=False,
            tooltip="fold / unfold the selected family (its running and failed stages stay listed)",
        ),
        Binding("Z", "fold_all", "Fold all", show=False, tooltip="fold / unfold every family"),
    ]
    DEFAULT_CSS = """
    StageBoard { height: 1fr; }
    StageBoard > .board--header { text-style: bold; background: $panel; }
    StageBoard > .board--cursor { background: $block-cursor-background; color: $block-cursor-foreground;
                                  text-style: bold; }
    StageBoard:blur > .board--cursor { background: $block-cursor-blurred-background; }
    """
    COMPONENT_CLASSES = {"board--header", "board--cursor"}

    class Highlighted(Message):
        def __init__(self, key: str | None) -> None:
            super().__init__()
            self.key = key

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.filter_text = ""
        self._rows: list[_Row] = []
        self._index: dict[str, int] = {}
        self._last_members: set[str] = set()
        self._cache: dict[tuple, Strip] = {}
        self.cursor_row = 0
        self._stage_w = 20
        self._bar_w = BAR_WIDE
        self._content_sig: int = 0
        self._width_cache: tuple[tuple, list[int]] = ((), [])
        self._frame_style: Style | None = None  # the widget's own style, looked up once per frame
        self.empty_note = ""  # shown while there is no stage (the app: what it waits for)
        self._alerted: dict[str, list[str]] = {}  # stage -> kinds of its open alerts (the run's records)
        self.room = 0  # stage rows the board may show (0: no limit); the app sets it from the terminal
        self.folds: dict[str, bool] = {}  # families the operator folded (True) or unfolded (False)
        self.auto_folded: set[str] = set()  # families folded because the rows did not fit the room
        self._families: list[tuple[str, list[StageView]]] = []

    # ------------------------------------------------------------------------------ queries
    @property
    def row_count(self) -> int:
        return len(self._rows)

    def get_row(self, key: str) -> tuple[Cell, ...]:
        return self._rows[self._index[key]].cells

    @property
    def selected_key(self) -> str | None:
        if not self._rows:
            return None
        return self._rows[min(self.cursor_row, len(self._rows) - 1)].key

    def shows(self, key: str) -> bool:
        """Whether ``key`` has a row now (not folded away, not filtered out)."""
        return key in self._index

    def selected_stage(self, model: RunModel) -> StageView | None:
        key = self.selected_key
        if key is None or key.startswith(GROUP_PREFIX):
            return None
        return model.stages.get(key)

    # ------------------------------------------------------------------------------ model -> rows
    def is_folded(self, fam: str) -> bool:
        """Whether ``fam`` shows only its header and its members that need a look (``needs_a_look``)."""
        if self.filter_text:
            return False  # a filter lists every match
        return self.folds.get(fam, fam in self.auto_folded)

    def _auto_fold(self, families: list[tuple[str, list[StageView]]]) -> None:
        self.auto_folded = set() if self.filter_text else auto_folds(families, self.folds, self.room)

    def _visible(self, model: RunModel) -> list[tuple[str, StageView | None, list[StageView]]]:
        rows: list[tuple[str, StageView | None, list[StageView]]] = []
        self._last_members = set()
        f = self.filter_text.lower()
        self._families = model.families()
        self._auto_fold(self._families)
        for fam, members in self._families:
            shown = [m for m in members if not f or f in m.id.lower() or f in m.display_state]
            if not shown:
                continue
            if len(members) > 1:
                rows.append((GROUP_PREFIX + fam, None, members if self.is_folded(fam) else shown))
                if self.is_folded(fam):
                    shown = [m for m in shown if needs_a_look(m)]
                rows.extend((m.id, m, []) for m in shown)
                if shown:
                    self._last_members.add(shown[-1].id)
            else:
                rows.append((shown[0].id, shown[0], []))
        return rows

    def family_of(self, key: str | None) -> str | None:
        """The family of a row (a family header's, or a member's of a family of several)."""
        if key is None:
            return None
        if key.startswith(GROUP_PREFIX):
            return key[len(GROUP_PREFIX) :]
        return next((fam for fam, ms in self._families if len(ms) > 1 and any(m.id == key for m in ms)), None)

    def sync(self, model: RunModel) -> None:
        now = time.time()
        selected = self.selected_key
        self._alerted = {sid: sorted({r.kind for r in rs}) for sid, rs in model.alerts.open_stages().items()}
        new = [_Row(key, self._cells(key, st, members, now)) for key, st, members in self._visible(model)]
        old = self._rows
        if [r.sig for r in new] == [r.sig for r in old]:
            return  # nothing changed: no repaint at all
        structure_changed = [r.key for r in new] != [r.key for r in old]
        width = self.scrollable_content_region.width
        before = (list(self._widths(width)), self._bar_w)
        self._rows = new
        self._index = {r.key: i for i, r in enumerate(new)}
        self._stage_w = max([len(str(r.cells[0])) for r in new] + [12]) + 1
        self._content_sig = hash(tuple(tuple(_plain_len(c) for c in r.cells[:-1]) for r in new))
        columns_changed = (self._widths(width), self._bar_w) != before  # then every line moves
        if structure_changed:
            self.virtual_size = Size(self.size.width, len(new) + 1)
            row = self._index.get(selected) if selected else 0
            if row is None:  # folded away: its family's row, else where the cursor was
                fam = self.family_of(selected)
                row = self._index.get(GROUP_PREFIX + fam if fam else "", min(self.cursor_row, len(new) - 1))
            self.cursor_row = max(0, row)
            if self.selected_key != selected:
                self.post_message(self.Highlighted(self.selected_key))
            self.scroll_to_cursor()
        if structure_changed or columns_changed:
            self.refresh()
            return
        top = int(self.scroll_offset.y)  # same rows, same columns: repaint the lines of rows that changed
        ys = [i + 1 - top for i, (a, b) in enumerate(zip(old, new, strict=True)) if a.sig != b.sig]
        if dirty := [Region(0, y, self.size.width, 1) for y in ys if 1 <= y < self.size.height]:
            self.refresh(*dirty)

    def render_lines(self, crop: Region) -> list[Strip]:
        self._frame_style = self.rich_style  # walks every ancestor's styles: once a frame, not once a line
        return super().render_lines(crop)

    def _style(self, state: str) -> str:
        style_of = getattr(self.app, "state_style", None)
        return style_of(state) if style_of else ""

    def _cells(
        self, key: str, st: StageView | None, members: list[StageView], now: float
    ) -> tuple[Cell, ...]:
        if st is None:  # a family header
            fam = key[len(GROUP_PREFIX) :]
            done = sum(m.progress.done for m in members)
            total = sum(m.progress.total or 0 for m in members)
            counts: dict[str, int] = {}
            for m in members:
                counts[m.display_state] = counts.get(m.display_state, 0) + 1
            summary = Text()
            for i, (state, n) in enumerate(sorted(counts.items(), key=lambda kv: -kv[1])):
                if i:
                    summary.append(" · ")
                summary.append(f"{n} {state}", style=self._style(state))
            rate = sum((m.progress.rate(now) or 0) for m in members if m.state == StageState.RUNNING) or None
            unit = next((m.progress.unit for m in members if m.progress.unit), "")
            eta = (
                max(
                    (m.progress.eta_s(now) or 0 for m in members if m.state == StageState.RUNNING),
                    default=None,
                )
                or None
            )
            spans = [(m.started_at, m.started_at + (m.elapsed_s(now) or 0)) for m in members if m.started_at]
            elapsed = max(e for _, e in spans) - min(b for b, _ in spans) if spans else None
            # A family row shows the state that most needs the operator's eye.
            overall = next((s for s in FAMILY_PRECEDENCE if s in counts), "pending")
            return (
                Text(f"{'▸' if self.is_folded(fam) else '▾'} {fam} ({len(members)})", style="bold"),
                Text(overall, style=self._style(overall)),
                "",
                fmt.duration(elapsed),
                _Bar(done / total if total else None),
                f"{fmt.count(done)}/{fmt.count(total)}" if total else "",
                fmt.rate(rate, unit) if rate else "",
                fmt.duration(eta) if eta else "",
                summary,
            )
        branch = "└" if st.id in self._last_members else "├"
        label = f" {branch} {st.id}" if st.family != st.id else st.id
        state = st.display_state
        frac = st.progress.fraction
        done_text = (
            f"{fmt.count(st.progress.done)}/{fmt.count(st.progress.total)}"
            if st.progress.total
            else (fmt.count(st.progress.done) if st.progress.t else "")
        )
        running = st.state == StageState.RUNNING
        eta = st.progress.eta_s(now) if running else None  # decayed by a silence
        return (
            label,
            Text(state, style=self._style(state)),
            str(st.attempt),
            fmt.duration(st.elapsed_s(now)),
            _Bar(frac),
            done_text,
            fmt.rate(st.progress.rate(now), st.progress.unit) if running and st.progress.t else "",
            fmt.duration(eta) if eta is not None else "",
            self._note(st),
        )

    def _note(self, st: StageView) -> str | Text:
        return alerted_note(st, self._alerted.get(st.id), self._style("failed"))

    # ------------------------------------------------------------------------------ rendering
    def _widths(self, total: int) -> list[int]:
        """Column widths for a board ``total`` cells wide (0: the column is not shown)."""
        key = (total, self._content_sig)
        if self._width_cache[0] == key:
            return self._width_cache[1]
        cols = list(COLUMNS)
        widest = [
            max([len(c) for c in cols][i], *(_plain_len(r.cells[i]) for r in self._rows)) + 1
            if self._rows
            else len(cols[i]) + 1
            for i in range(len(cols))
        ]
        widest[0] = self._stage_w
        bar_i = cols.index("Progress")
        bar_w = BAR_WIDE
        widths = widest[:-1]
        for step in ("bar", *DROP_ORDER):
            if total - sum(widths) >= NOTE_MIN:
                break
            if step == "bar":
                bar_w = BAR_NARROW
                if widths[bar_i] > 1:
                    widths[bar_i] -= BAR_WIDE - BAR_NARROW
            else:
                widths[cols.index(step)] = 0
        widths.append(max(0, total - sum(widths)))
        self._bar_w = bar_w
        self._width_cache = (key, widths)
        return widths

    def _strip(self, cells: tuple[Cell, ...], widths: list[int], width: int, base: Style) -> Strip:
        """``cells`` in ``widths`` on ``base``, each cut to its width less one (with "…") and padded: plain cells
        as strings (a run of them one segment), styled ones (state, family counts) through Rich, once each."""
        out: list[Segment] = []
        run: list[str] = []
        for cell, w in zip(cells, widths, strict=True):
            if w <= 0:
                continue
            if isinstance(cell, _Bar) and self._bar_w != BAR_WIDE:
                cell = _bar(cell.fraction, self._bar_w)
            if not isinstance(cell, Text):
                run.append(_fit(str(cell), w))
                continue
            if run:
                out.append(Segment("".join(run), base))
                run = []
            key = ("cell", cell.plain, str(cell.style), tuple(cell.spans), w, base)
            if key not in self._cache:  # a state's word is on many rows, every poll: render it once
                t = cell.copy()
                t.truncate(w - 1, overflow="ellipsis")
                t.pad_right(w - t.cell_len)
                t = Text().append_text(t)  # its own style as a span: Text.render draws spans only
                self._cache[key] = Strip(
                    Segment(sg.text, base + sg.style if sg.style else base, sg.control)
                    for sg in t.render(self.app.console)
                )
            out.extend(self._cache[key])
        if run:
            out.append(Segment("".join(run), base))
        return Strip(out).crop_extend(0, width, base)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width  # without the scrollbar: nothing hides under it
        widths = self._widths(width)
        if y == 0:
            style = self.get_component_rich_style("board--header")
            key: tuple = ("header", width, tuple(widths), style)
            if key not in self._cache:
                self._cache[key] = self._strip(COLUMNS, widths, width, style)
            return self._cache[key]
        idx = y - 1 + int(self.scroll_offset.y)
        base = self._frame_style or self.rich_style
        if idx >= len(self._rows):
            if idx == 0 and self.empty_note:  # no stage yet: what the console waits for, and why
                return Strip([Segment(_fit(self.empty_note, width), base)]).crop_extend(0, width, base)
            return Strip.blank(width, base)
        row = self._rows[idx]
        selected = idx == self.cursor_row
        style = self.get_component_rich_style("board--cursor") if selected else base
        key = (row.key, row.sig, width, tuple(widths), selected, style)
        strip = self._cache.get(key)
        if strip is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            strip = self._cache[key] = self._strip(row.cells, widths, width, style)
        return strip

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.refresh()

    # ------------------------------------------------------------------------------ cursor
    def _move_to(self, row: int) -> None:
        if not self._rows:
            return
        row = max(0, min(len(self._rows) - 1, row))
        if row != self.cursor_row:
            self.cursor_row = row
            self.refresh()
            self.post_message(self.Highlighted(self.selected_key))
        self.scroll_to_cursor()

    def scroll_to_cursor(self) -> None:
        """Scroll so that the selected row is on screen (under the column header)."""
        row = self.cursor_row
        height = max(1, self.size.height - 1)
        if row < self.scroll_offset.y:
            self.scroll_to(y=row, animate=False)
        elif row >= self.scroll_offset.y + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def on_resize(self, _event: Resize) -> None:
        self.call_after_refresh(self.scroll_to_cursor)  # once the new height is laid out

    def _refold(self) -> None:
        """Rebuild the rows after a fold changed (the app's next poll would too; the operator sees it now)."""
        model = getattr(self.app, "model", None)
        if model is not None:
            self.sync(model)

    def action_fold(self) -> None:
        """Fold or unfold the selected row's family."""
        fam = self.family_of(self.selected_key)
        if fam is None:
            self.notify("a single stage: nothing to fold (z folds a family such as prep)", severity="warning")
            return
        self.folds[fam] = not self.is_folded(fam)
        self._refold()

    def action_fold_all(self) -> None:
        """Fold every family, or unfold every family when all are folded."""
        groups = [fam for fam, ms in self._families if len(ms) > 1]
        fold = not all(self.is_folded(fam) for fam in groups)
        self.folds = dict.fromkeys(groups, fold)
        self._refold()

    def action_cursor(self, delta: int) -> None:
        self._move_to(self.cursor_row + delta)

    def action_cursor_to(self, row: int) -> None:
        self._move_to(row if row >= 0 else len(self._rows) - 1)

    def move_cursor(self, row: int) -> None:
        self._move_to(row)

    def select_key(self, key: str, unfold: bool = True) -> bool:
        """Put the cursor on the row of ``key``; False if it has none (unknown, or filtered out). Folded away:
        its family is unfolded to show it, or with ``unfold=False`` (the console's own choice, which must not
        undo the folds that fit the board to the terminal) its family's row is selected."""
        row = self._index.get(key)
        if row is None and (fam := self.family_of(key)) is not None and self.is_folded(fam):
            if not unfold:
                return self._move_to_key(GROUP_PREFIX + fam)
            self.folds[fam] = False  # folded away: unfold its family to show it
            self._refold()
            row = self._index.get(key)
        if row is None:
            return False
        self._move_to(row)
        return True

    def _move_to_key(self, key: str) -> bool:
        row = self._index.get(key)
        if row is not None:
            self._move_to(row)
        return row is not None

    def on_click(self, event: Click) -> None:
        if event.y >= 1:
            self._move_to(int(self.scroll_offset.y) + event.y - 1)
