"""The detail pane: the selected stage's facts, its last events (or, for a stage with a loss curve, a
compact plot of loss and acc_0) and the live tail of its log.

On a wide terminal (``-wide`` on the app, 170 columns and more) the plot is a column of its own
between the facts and the log; narrower, it takes the place of the event list under the facts, so the
log keeps the width it needs to be read; on a short terminal (under 36 rows) there is no room for it
there, and ``m`` (the metrics view) has the curves. Under 100 columns (``-narrow``) the log goes under the
facts, full width, or on a short terminal is left out (``l`` opens the log viewer; the pane says so): a
log 33 columns wide shows nothing of a line. The app's CSS holds these rules (they key on its classes)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.events import Blur, Focus, Resize
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Log, Static

from console import fmt
from console.model import StageView
from console.widgets.board import server_line
from console.widgets.curves import CurvePlot, mini_curves
from pipeline.run.rundir.protocol import Message, describe
from pipeline.run.supervise.force_text import CHECKS


class EventTail(Widget):
    """The stage's last events, as many as fit: the newest at the bottom, whatever height the pane gets (the
    lines are wrapped and cut at draw time, so a pane that grows shows more and the latest is never cut)."""

    MAX = 50

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.lines: list[Text] = []

    def set_lines(self, lines: list[Text]) -> None:
        grew = len(lines) != len(self.lines)
        self.lines = lines[-self.MAX :]
        self.refresh(layout=grew)  # its auto height (a narrow pane) follows the count

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.lines)

    def render(self) -> Text:
        h, w = self.size.height, self.size.width
        if not self.lines or h <= 0 or w <= 0:
            return Text("")
        wrapped = Text("\n").join(self.lines).wrap(self.app.console, w)
        return Text("\n").join(list(wrapped)[-h:])


class TailLog(Log):
    """The log tail: while it shows the end (the latest lines, a traceback) it keeps showing it when the pane
    is laid out again (the first layout after a stage is selected, a resize); scrolled up, it stays put.

    A click focuses it: then its keys scroll it, not the board. That is shown (a thick accent edge, and the
    detail pane's title says so) and its keys carry help lines, so ``?`` lists them; Esc gives the board
    its keys back."""

    follow = True
    FOCUSED_TITLE = "log pane focused: ↑/↓ PgUp/PgDn Home/End scroll it · Esc or Tab: back to the board"
    BINDINGS = [
        Binding("up", "scroll_up", show=False, tooltip="scroll the focused log pane up / down"),
        Binding("down", "scroll_down", show=False, tooltip="scroll the focused log pane up / down"),
        Binding("pageup", "page_up", show=False, tooltip="a page of the focused log pane up / down"),
        Binding("pagedown", "page_down", show=False, tooltip="a page of the focused log pane up / down"),
        Binding("home", "scroll_home", show=False, tooltip="the focused log pane's first / last line"),
        Binding("end", "scroll_end", show=False, tooltip="the focused log pane's first / last line"),
        Binding("escape", "app.focus_board", "Board", tooltip="leave the log pane: the board's keys again"),
    ]
    DEFAULT_CSS = """
    TailLog:focus { border-left: thick $accent; }
    AerieApp.-narrow TailLog:focus { border-top: thick $accent; }
    """

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.follow = self.is_vertical_scroll_end

    def on_focus(self, _event: Focus) -> None:
        self._say(self.FOCUSED_TITLE)

    def on_blur(self, _event: Blur) -> None:
        self._say("")

    def _say(self, title: str) -> None:
        """The title of the pane above (the app's ``#bottom``, whose top edge it is drawn in)."""
        for pane in self.ancestors_with_self:
            if pane.id == "bottom" and isinstance(pane, Widget):
                pane.border_title = title

    def on_resize(self, _event: Resize) -> None:
        if self.follow:
            self.call_after_refresh(self.scroll_end, animate=False, x_axis=False)


class StageDetail(Horizontal):
    """Shows one stage. :meth:`show` switches stage; :meth:`sync` appends what is new."""

    DEFAULT_CSS = """
    StageDetail { height: 1fr; }
    StageDetail #info { width: 46; padding: 0 1; }
    StageDetail #facts { height: auto; max-height: 6; }
    StageDetail #events { height: 1fr; color: $text-muted; }
    StageDetail Log { width: 1fr; border-left: solid $panel-lighten-2; }
    StageDetail CurvePlot { display: none; }
    StageDetail #plot-col { width: 46; border-left: solid $panel-lighten-2; }
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.stage_id: str | None = None
        self.family_note = (
            ""  # a family's row is selected: the app shows its stage most worth a look, and says so
        )
        self._log_count = 0
        self._facts_lines = -1  # the facts' line count last drawn: only a change of it needs a new layout
        self._drawn: dict[str, tuple] = {}  # what #facts and #events show now (a same text is not redrawn)

    def compose(self) -> ComposeResult:
        with Vertical(id="info"):
            yield Static("Select a stage", id="facts")
            yield EventTail(id="events")
            yield CurvePlot(id="plot-in")
        yield CurvePlot(id="plot-col")
        yield TailLog(max_lines=1000, auto_scroll=True, id="stage-log")

    def _plot(self, st: StageView) -> None:
        """The compact loss / acc_0 plot, where the width puts it (or none for a stage without a loss)."""
        curves = mini_curves(st.history)
        wide = self.app.has_class("-wide")
        if not wide and self.app.has_class("-short"):
            curves = []  # under the facts it would get 3 rows: the events are more use there (m has the curves)
        try:
            col, inner = self.query_one("#plot-col", CurvePlot), self.query_one("#plot-in", CurvePlot)
        except NoMatches:  # a poll that came before the pane was composed: the next refresh draws it
            return
        target = (col if wide else inner) if curves else None
        for plot in (col, inner):
            if plot.display != (plot is target):
                plot.display = plot is target
        self.query_one("#events").display = target is not inner
        if target is not None:
            target.draw([("", curves)], "step", key=(st.id, st.history.version, wide), compact=True)

    def _changed(self, what: str, text: Text) -> bool:
        """True (and remembered) when ``text`` differs from what ``what`` shows: an unchanged Static is not
        repainted (a repaint there widens the screen region each poll redraws to the bottom pane)."""
        key = (text.plain, tuple((sp.start, sp.end, str(sp.style)) for sp in text.spans))
        if self._drawn.get(what) == key:
            return False
        self._drawn[what] = key
        return True

    def show(self, st: StageView | None) -> None:
        if st is None or st.id != self.stage_id:
            self.query_one(Log).clear()
            self._log_count = 0
        self.stage_id = st.id if st else None
        self.sync(st)

    def sync(self, st: StageView | None) -> None:
        facts = self.query_one("#facts", Static)
        if st is None:
            self._drawn.clear()
            facts.update("Select a stage (↑/↓)")
            self.query_one(EventTail).set_lines([])
            for plot in self.query(CurvePlot):
                plot.display = False
            self.query_one("#events").display = True
            return
        style = getattr(self.app, "state_style", lambda s: "")
        t = Text()
        if self.family_note:
            t.append(self.family_note + "\n", style="italic")
        t.append(st.id, style="bold")
        t.append("  ")
        t.append(st.display_state, style=style(st.display_state))
        t.append(f" · attempt {st.attempt}")
        if self.app.has_class("-narrow") and self.app.has_class("-short"):
            t.append(" · l: its log", style="italic")  # no room for the log's tail here
        t.append("\n")
        if st.pid:
            t.append(f"pid {st.pid} · pgid {st.pgid}")
        if st.started_at:
            t.append(
                f" · started {time.strftime('%H:%M:%S', time.localtime(st.started_at))}"
                f" · elapsed {fmt.duration(st.elapsed_s())}"
            )
        if st.returncode is not None:
            t.append(f" · exit {st.returncode}")
        if st.reason:
            t.append(f"\n{st.reason}", style="italic")
        if st.force_armed:
            t.append(
                f"\n⚑ --force armed for attempt {st.attempt}: it starts without {CHECKS} "
                "(F again disarms it; aerie force --cancel RUN STAGE)",
                style="bold",
            )
        if st.progress.t:
            t.append(
                f"\n{fmt.count(st.progress.done)}/{fmt.count(st.progress.total)} {st.progress.unit}"
                f" · {fmt.rate(st.progress.rate(), st.progress.unit)}"
            )
        live = server_line(st)
        if live:
            t.append(f"\nserver: {live}")
        elif st.metrics:
            shown = list(st.metrics.items())[-8:]
            t.append("\n" + "  ".join(f"{k}={v:.4g}" for k, v in shown))
        lines_now = t.plain.count("\n")
        # Re-layout only when the facts grow or shrink by a line: the elapsed time and the rate change every
        # poll, and a layout pass of the whole screen per poll was most of the live console's CPU.
        if self._changed("facts", t):
            facts.update(t, layout=lines_now != self._facts_lines)
        self._facts_lines = lines_now
        self._plot(st)
        evs = list(st.events)[-EventTail.MAX :]  # progress events are the board's bar, not listed
        lines = [
            Text(
                f"{time.strftime('%H:%M:%S', time.localtime(ev.t))} {describe(ev)}",
                style=style("failed") if isinstance(ev, Message) and ev.level == "error" else "",
            )
            for ev in evs
        ]
        if self._changed("events", Text("\n").join(lines)):
            self.query_one(EventTail).set_lines(lines)
        log = self.query_one(TailLog)
        fresh = st.log_total - self._log_count
        if fresh > 0:
            log.write_lines(list(st.log)[-min(fresh, len(st.log)) :])
            if self._log_count == 0:  # a stage just selected: its tail (the traceback) in view once laid out
                log.follow = True
                self.call_after_refresh(log.scroll_end, animate=False, x_axis=False)
        self._log_count = st.log_total
