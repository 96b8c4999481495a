"""The log screen: one stage's log (or the inference server's), of any size, live.

It drives a :class:`~console.logindex.LogIndex` (the line index, through the transport) and a
:class:`~console.widgets.logview.LogView` (renders only what is visible). A timer re-indexes what
was appended — every 0.05 s while the log grows, every 0.2 s when it is quiet — in a worker, so the
UI loop never waits on a read, and over SSH the index and searches run on the host.

Keys: follow (``f``/``End``; scrolling up pauses it), top (``g``/``Home``), wrap (``w``),
timestamps (``t``), search (``/``, then ``n``/``N``), filter (``&``: only matching lines), first
error (``e``), help (``?``), back (``Esc``/``q``).
"""

from __future__ import annotations

import re
import time

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from console import fmt
from console.logindex import LogFilter, LogIndex, Row
from console.widgets.logview import LogView
from pipeline.run.rundir.logscan import ERROR_PATTERN, ScanError, compile_pattern

POLL_S = 0.05  # while the log grows
IDLE_POLL_S = 0.2  # once it has been quiet for IDLE_AFTER_S
IDLE_AFTER_S = 2.0
SEARCH_BATCH = 256  # filtered rows read per step when searching inside a filter


def str_pattern(pattern: str) -> re.Pattern[str]:
    """The highlight regex for a search pattern (same smart case as the byte search)."""
    flags = re.IGNORECASE if pattern == pattern.lower() else 0
    return re.compile(pattern, flags)


class LogScreen(Screen[None]):
    """A full-screen, live view of one run-dir log."""

    BINDINGS = [
        Binding(
            "escape", "back", "Back", tooltip="close the search box, else clear the filter, else go back"
        ),
        Binding("q", "close", "Back", show=False, tooltip="back to the board (the stage keeps running)"),
        Binding("f,end", "follow", "Follow", tooltip="follow the end of the log; scrolling up pauses it"),
        Binding("g,home", "top", "Top", tooltip="the first line (pauses follow)"),
        Binding("w", "wrap", "Wrap", tooltip="wrap long lines on/off"),
        Binding("t", "timestamps", "Timestamps", tooltip="hide/show the timestamp at the start of lines"),
        Binding("slash", "search", "Search", tooltip="search (regex, smart case); Enter jumps to the match"),
        Binding("n", "next", "Next", tooltip="next match below"),
        Binding("N", "previous", "Prev", show=False, tooltip="previous match above"),
        Binding(
            "ampersand", "filter", "Filter", tooltip="show only the lines matching a regex; empty clears"
        ),
        Binding(
            "e",
            "first_error",
            "First error",
            tooltip="jump to the first error or traceback; n/N: the next ones",
        ),
        Binding("question_mark", "help", "Help", tooltip="every key of this screen"),
    ]
    DEFAULT_CSS = """
    LogScreen #log-title { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    LogScreen #log-status { height: 1; padding: 0 1; color: $text-muted; background: $panel; }
    LogScreen #log-input { display: none; }
    LogScreen #log-input.visible { display: block; }
    """

    def __init__(self, index: LogIndex, title: str, poll_s: float = POLL_S) -> None:
        super().__init__()
        self.index = index
        self.title_text = title
        self.poll_s = poll_s
        self.filter: LogFilter | None = None
        self.search_pattern: str | None = None
        self.input_mode: str | None = None  # "search" | "filter" while the box is open
        self.error: str | None = None
        self.note = ""
        self.seen_total = 0  # rows when follow was paused (for "+N new")
        self._updating = False
        self._last_growth = time.monotonic()
        self._last_check = 0.0
        self._tail_mode = False
        self._fetching = False  # a fetch of rows for the view is in flight
        self.updates = 0  # completed index updates (tests and benchmarks wait on it)
        self._status_shown = ""

    # ------------------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(Text.assemble((self.title_text, "bold"), "  ", (self.index.path, "dim")), id="log-title")
        yield LogView(id="log-view")
        yield Input(id="log-input")
        yield Static("", id="log-status")
        yield Footer()

    @property
    def view(self) -> LogView:
        return self.query_one(LogView)

    def on_mount(self) -> None:
        self.view.focus()
        self.set_interval(self.poll_s, self._tick)
        self._tick(force=True)

    # ------------------------------------------------------------------------------ updating
    def _tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._tail_mode and not self._fetching:
            self.view.ask_again()  # a request for the visible rows that was dropped or cancelled: asked again
        if self._updating:
            return
        if not force and now - self._last_growth > IDLE_AFTER_S and now - self._last_check < IDLE_POLL_S:
            return
        self._last_check = now
        self._updating = True
        self.run_update()

    @work(group="log-update")
    async def run_update(self) -> None:
        try:
            await self._update()
            self.error = None
        except ScanError as exc:
            self.error = str(exc)
        except Exception as exc:  # a transport drop: keep what is shown, say why
            self.error = f"cannot read the log: {exc}"
        finally:
            self._updating = False
            self.updates += 1
        self._status()

    async def _update(self) -> None:
        ix, view = self.index, self.view
        # Until the first scan reaches the end, one bounded step per tick, so the end shows at once.
        changed = await ix.update() if ix.caught_up else await ix.update(calls=1)
        if self.filter is not None and ix.caught_up:
            changed = await self.filter.update() or changed
        if changed:
            self._last_growth = time.monotonic()
        if not ix.caught_up:
            # A long log is still being indexed: show its end now, straight from the file.
            if changed or not self._tail_mode:
                self._tail_mode = True
                rows = await ix.tail_lines(3 * view.page)
                view.set_total(len(rows), line_digits=len(f"{ix.lines:,}") - 1)
                view.set_window(0, rows)
            return
        if self._tail_mode:
            self._tail_mode = False
            view.window, view.window_first = [], 0
            changed = True
        if not changed and view.total == self._rows_total():
            return
        total = self._rows_total()
        view.set_total(total, line_digits=len(str(max(ix.lines, 1))))
        if view.following:
            first = max(0, total - 2 * view.page)
            view.set_window(first, await self._rows(first, 2 * view.page))
        elif view.window and view.window_first + len(view.window) >= total - 1:
            # The last line shown may have been unfinished: read the window again.
            view.set_window(view.window_first, await self._rows(view.window_first, len(view.window) + 1))

    def _rows_total(self) -> int:
        return self.filter.count if self.filter is not None else self.index.lines

    async def _rows(self, first: int, count: int) -> list[Row]:
        if self.filter is not None:
            return await self.filter.read_rows(first, count)
        return await self.index.read_lines(first, count)

    @on(LogView.Wanted)
    def _wanted(self, event: LogView.Wanted) -> None:
        if not self._tail_mode:
            self.fetch(event.first, event.count)

    @work(exclusive=True, group="log-fetch")
    async def fetch(self, first: int, count: int) -> None:
        self._fetching = True
        try:
            rows = await self._rows(first, count)
        except Exception as exc:
            self.error = f"cannot read the log: {exc}"
            self._status()
            return
        finally:
            self._fetching = False
        self.view.set_window(first, rows)

    @on(LogView.FollowChanged)
    def _follow_changed(self, event: LogView.FollowChanged) -> None:
        self.seen_total = self.view.total
        self._status()

    # ------------------------------------------------------------------------------ status
    def _status(self) -> None:
        try:
            view = self.view
        except NoMatches:  # a refresh that lands while the screen is being dismissed: nothing left to show
            return
        ix = self.index
        t = Text()
        if self.error:
            t.append(self.error + "  ", style="bold")
        if ix.size < 0:
            t.append("no log yet (the stage has not started)")
        else:
            lines = f"{ix.lines:,} lines" if ix.caught_up else f"indexing {ix.fraction_indexed:.0%}"
            t.append(f"{lines} · {fmt.size(ix.size)}")
        if view.following:
            t.append(" · FOLLOW", style="bold")
        else:
            new = view.total - self.seen_total
            t.append(
                " · paused" + (f": +{new:,} new (End follows)" if new > 0 else " (End follows)"), style="bold"
            )
        if view.wrap:
            t.append(" · wrap")
        if view.hide_timestamps:
            t.append(" · timestamps hidden")
        if self.filter is not None:
            f = self.filter
            scan = "" if f.done else f" (scanning {f.fraction_scanned:.0%})"
            dropped = f", oldest {f.dropped:,} dropped" if f.dropped else ""
            t.append(f" · filter /{f.pattern}/: {f.count:,} lines{scan}{dropped}")
        if self.search_pattern:
            label = "errors" if self.search_pattern == ERROR_PATTERN else f"/{self.search_pattern}/"
            at = f" at line {view.found_line + 1:,}" if view.found_line is not None else ""
            t.append(f" · search {label}{at}")
        if self.note:
            t.append(f" · {self.note}")
        if t.plain != self._status_shown:  # a one-line Static: no re-layout, and only on change
            self._status_shown = t.plain
            try:
                self.query_one("#log-status", Static).update(t, layout=False)
            except NoMatches:  # a refresh that lands while the screen is being dismissed
                self._status_shown = ""

    # ------------------------------------------------------------------------------ actions
    def _need_index(self) -> bool:
        if self.index.caught_up:
            return True
        self.notify(
            f"still indexing the log ({self.index.fraction_indexed:.0%}); try again in a moment",
            severity="warning",
            timeout=3,
        )
        return False

    def action_follow(self) -> None:
        self.view.follow()
        self._status()

    def action_top(self) -> None:
        if self._need_index():
            self.view.go_to(0)
            self.view.scroll_to(y=0, animate=False)

    def action_wrap(self) -> None:
        self.view.set_options(wrap=not self.view.wrap)
        self._status()

    def action_timestamps(self) -> None:
        self.view.set_options(hide_timestamps=not self.view.hide_timestamps)
        self._status()

    def _open_input(self, mode: str, placeholder: str, value: str) -> None:
        box = self.query_one("#log-input", Input)
        self.input_mode = mode
        box.placeholder = placeholder
        box.value = value
        box.add_class("visible")
        box.focus()

    def _close_input(self) -> None:
        self.input_mode = None
        self.query_one("#log-input", Input).remove_class("visible")
        self.view.focus()

    def action_search(self) -> None:
        self._open_input(
            "search",
            "search: a regex (smart case) — Enter jumps to the match, then n / N",
            self.search_pattern if self.search_pattern not in (None, ERROR_PATTERN) else "",
        )

    def action_filter(self) -> None:
        self._open_input(
            "filter",
            "filter: show only lines matching this regex — empty clears",
            self.filter.pattern if self.filter else "",
        )

    @on(Input.Submitted, "#log-input")
    def _submitted(self, event: Input.Submitted) -> None:
        mode, value = self.input_mode, event.value.strip()
        self._close_input()
        if mode == "search" and value:
            self.set_search(value)
            self.find(backward=self.view.following and self.view.found_line is None)
        elif mode == "filter":
            self.set_filter(value or None)

    def set_search(self, pattern: str) -> bool:
        try:
            compile_pattern(pattern)
            rx = str_pattern(pattern) if pattern != ERROR_PATTERN else re.compile(ERROR_PATTERN)
        except (ScanError, re.error) as exc:
            self.notify(str(exc), severity="error")
            return False
        self.search_pattern = pattern
        self.view.set_options(search=rx, found_line=None)
        self._status()
        return True

    def set_filter(self, pattern: str | None) -> None:
        if pattern is None:
            self.filter = None
        else:
            try:
                self.filter = LogFilter(self.index, pattern)
            except ScanError as exc:
                self.notify(str(exc), severity="error")
                return
        self.view.clear()
        self.view.follow()
        self._tick(force=True)
        self._status()

    def action_next(self) -> None:
        if self.search_pattern is None:
            self.action_search()
        elif self._need_index():
            self.find(backward=False)

    def action_previous(self) -> None:
        if self.search_pattern is None:
            self.action_search()
        elif self._need_index():
            self.find(backward=True)

    def action_first_error(self) -> None:
        if self._need_index() and self.set_search(ERROR_PATTERN):
            self.find(backward=False, from_top=True)

    def action_back(self) -> None:
        if self.input_mode is not None:
            self._close_input()
        elif self.filter is not None:
            self.set_filter(None)
        else:
            self.action_close()

    def action_close(self) -> None:
        self.dismiss(None)

    def action_help(self) -> None:
        from console.screens.dialogs import HelpScreen, help_sections

        self.app.push_screen(
            HelpScreen(
                help_sections(self),
                title="Log viewer — keys",
                notes="The log is read in place: nothing is loaded whole, however large it is.",
            )
        )

    # ------------------------------------------------------------------------------ search
    @work(exclusive=True, group="log-find")
    async def find(self, backward: bool, from_top: bool = False) -> None:
        pattern = self.search_pattern
        if pattern is None:
            return
        view = self.view
        try:
            if self.filter is not None:
                line = await self._find_in_filter(backward, from_top)
            else:
                line = await self._find_in_file(pattern, backward, from_top)
        except Exception as exc:
            self.notify(f"search failed: {exc}", severity="error")
            return
        self.note = ""
        if line is None:
            what = (
                "no error or traceback in this log" if pattern == ERROR_PATTERN else f"/{pattern}/: no match"
            )
            self.notify(what + ("" if from_top else (" above" if backward else " below")), timeout=3)
        else:
            view.set_options(found_line=line)
            row = self.filter.row_of_line(line) if self.filter is not None else line
            view.go_to(row)
        self._status()

    def _current_line(self) -> int:
        view = self.view
        if view.found_line is not None:
            return view.found_line
        if view.following:
            return self.index.lines
        row = view.row(view.visible_first())
        return row.line if row is not None and row.line is not None else view.visible_first()

    async def _find_in_file(self, pattern: str, backward: bool, from_top: bool) -> int | None:
        ix = self.index
        cur = 0 if from_top else self._current_line()
        if backward:
            end, line0 = await ix.line_start(cur), cur
            start = 0
        else:
            first = cur if from_top or self.view.found_line is None else cur + 1
            start, line0, end = await ix.line_start(first), first, None
        while True:
            r = await ix.transport.find_lines(ix.path, pattern, start, end, line0, backward=backward, limit=1)
            if r["hits"]:
                return int(r["hits"][0][0])
            if r["done"]:
                return None
            if backward:
                end, line0 = int(r["next"]), int(r["next_line"])
                self.note = f"searching… {1 - end / max(ix.size, 1):.0%}"
            else:
                start, line0 = int(r["next"]), int(r["next_line"])
                self.note = f"searching… {start / max(ix.size, 1):.0%}"
            self._status()

    async def _find_in_filter(self, backward: bool, from_top: bool) -> int | None:
        f, view = self.filter, self.view
        assert f is not None and view.search is not None
        if from_top:
            i = 0
        elif view.found_line is not None:
            i = f.row_of_line(view.found_line) + (-1 if backward else 1)
        else:
            i = view.total - 1 if view.following else view.visible_first()
        while 0 <= i < f.count:
            first = max(0, i - SEARCH_BATCH + 1) if backward else i
            rows = await f.read_rows(first, SEARCH_BATCH)
            order = reversed(rows[: i - first + 1]) if backward else rows
            for r in order:
                if view.search.search(r.text):
                    return r.line
            i = first - 1 if backward else first + len(rows)
        return None
