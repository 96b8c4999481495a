"""The log pane: renders only the visible lines of a log of any size, through Textual's line API.

The widget holds no log. Its owner (the log screen) tells it how many rows there are
(:meth:`LogView.set_total`: the file's lines, or the filter's matches) and hands it the rows
around the visible region (:meth:`LogView.set_window`); when the visible region leaves that
window the widget posts :class:`LogView.Wanted` and the owner fetches those rows through the log
model. Scrolling a 10-million-line log costs what scrolling a 100-line one does.

Follow mode keeps the last line in view as rows are added; scrolling up pauses it (posting
:class:`LogView.FollowChanged`) and :meth:`follow` resumes it. Wrap, hiding leading timestamps,
search highlights and error/warning colouring are render-time options. Every colour comes from
the theme through component classes.
"""

from __future__ import annotations

import re

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.cache import LRUCache
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from console.logindex import Row
from pipeline.run.rundir.logscan import ERROR_PATTERN

ERROR_RE = re.compile(ERROR_PATTERN)
WARNING_RE = re.compile(r"\b(?:WARNING|WARN|Warning)\b|\bwarning:")
# A timestamp at the start of a line: 2026-12-02 14:05:01,123 / [2026-12-02T14:05:01Z] / 14:05:01.5
TIMESTAMP_RE = re.compile(
    r"^\[?(?:\d{4}-\d\d-\d\d[T ])?\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?(?:\s+|$)"
)


class LogView(ScrollView, can_focus=True):
    """A virtual list of log rows; see the module docstring for how it is fed."""

    BINDINGS = [
        Binding("up", "scroll_lines(-1)", "Up", show=False, tooltip="scroll up a line (pauses follow)"),
        Binding("down", "scroll_lines(1)", "Down", show=False, tooltip="scroll down a line"),
        Binding(
            "pageup", "scroll_lines(-0.9)", "Page up", show=False, tooltip="scroll up a page (pauses follow)"
        ),
        Binding("pagedown,space", "scroll_lines(0.9)", "Page down", show=False, tooltip="scroll down a page"),
        Binding("home", "screen.top", "Top", show=False, tooltip="the first line (pauses follow)"),
        Binding("end", "screen.follow", "Follow", show=False, tooltip="follow the end of the log"),
        Binding("left", "scroll_cols(-8)", "Left", show=False, tooltip="scroll left (without wrap)"),
        Binding("right", "scroll_cols(8)", "Right", show=False, tooltip="scroll right (without wrap)"),
    ]
    COMPONENT_CLASSES = {
        "logview--gutter",
        "logview--error",
        "logview--warning",
        "logview--match",
        "logview--found",
        "logview--pending",
    }
    DEFAULT_CSS = """
    LogView { height: 1fr; background: $surface; }
    LogView > .logview--gutter { color: $foreground-muted; }
    LogView > .logview--error { color: $error; }
    LogView > .logview--warning { color: $warning; }
    LogView > .logview--match { background: $accent; color: $background; text-style: bold; }
    LogView > .logview--found { background: $primary-muted; }
    LogView > .logview--pending { color: $foreground-muted; }
    """

    class Wanted(Message):
        """The visible rows are not in the window: fetch rows ``first .. first+count-1``."""

        def __init__(self, first: int, count: int) -> None:
            super().__init__()
            self.first, self.count = first, count

    class FollowChanged(Message):
        def __init__(self, following: bool) -> None:
            super().__init__()
            self.following = following

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.total = 0
        self.window_first = 0
        self.window: list[Row] = []
        self.following = True
        self.wrap = False
        self.hide_timestamps = False
        self.search: re.Pattern[str] | None = None
        self.found_line: int | None = None  # the line the last search landed on
        self.line_digits = 1
        self._auto = False
        self._wanted: tuple[int, int] | None = None
        self._strips: LRUCache[tuple, Strip] = LRUCache(
            256
        )  # a few screens: each Strip holds caches the GC scans
        self._layout_key: tuple | None = None
        self._layout: list[tuple[Row | None, Text | None, bool]] = []

    # ------------------------------------------------------------------------------ feeding
    def set_total(self, total: int, line_digits: int | None = None) -> None:
        """The number of rows changed (the log grew, a filter found more, or a reset)."""
        self.total = max(0, total)
        if line_digits is not None:
            self.line_digits = max(1, line_digits)
        self._set_virtual()
        if self.following:
            self._scroll_end()
        self.refresh()
        self.check_window()

    def set_window(self, first: int, rows: list[Row]) -> None:
        """Rows ``first .. first+len(rows)-1``, fetched by the owner."""
        self.window_first, self.window = first, rows
        self._wanted = None
        self._set_virtual()
        self.refresh()
        self.check_window()

    def clear(self) -> None:
        self.window_first, self.window, self._wanted = 0, [], None
        self.set_total(0)

    def row(self, index: int) -> Row | None:
        i = index - self.window_first
        return self.window[i] if 0 <= i < len(self.window) else None

    # ------------------------------------------------------------------------------ options
    def set_options(
        self,
        *,
        wrap: bool | None = None,
        hide_timestamps: bool | None = None,
        search: re.Pattern[str] | None | bool = False,
        found_line: int | None | bool = False,
    ) -> None:
        if wrap is not None:
            self.wrap = wrap
        if hide_timestamps is not None:
            self.hide_timestamps = hide_timestamps
        if search is not False:
            self.search = search  # type: ignore[assignment]
        if found_line is not False:
            self.found_line = found_line
        self._strips.clear()
        self._set_virtual()
        self.refresh()

    # ------------------------------------------------------------------------------ scrolling
    @property
    def page(self) -> int:
        return max(1, self.scrollable_content_region.height)

    def visible_first(self) -> int:
        if self.following:
            return max(0, self.total - self.page)
        return int(self.scroll_y)

    def holds_visible(self) -> bool:
        """Does the window hold every visible row?"""
        first = self.visible_first()
        last = min(self.total, first + self.page)
        return self.window_first <= first and last <= self.window_first + len(self.window)

    def check_window(self) -> None:
        """Ask for the visible rows if the window does not hold them (once per distinct request)."""
        if not self.total or self.holds_visible():
            return
        first = self.visible_first()
        want = (max(0, first - self.page), 3 * self.page)
        if want != self._wanted:
            self._wanted = want
            self.post_message(self.Wanted(*want))

    def ask_again(self) -> None:
        """The owner has no request in flight, yet the visible rows are missing (a request was dropped while
        the owner showed the file's tail, or cancelled by a newer one that then failed): ask once more."""
        if self.total and not self.holds_visible():
            self._wanted = None
            self.check_window()

    def follow(self) -> None:
        """Resume following: show the last rows and keep them in view."""
        if not self.following:
            self.following = True
            self.post_message(self.FollowChanged(True))
        self._scroll_end()
        self.refresh()
        self.check_window()

    def unfollow(self) -> None:
        if self.following:
            self.following = False
            self._auto = True
            try:
                self.scroll_to(y=max(0, self.total - self.page), animate=False)
            finally:
                self._auto = False
            self.post_message(self.FollowChanged(False))

    def go_to(self, row: int) -> None:
        """Show ``row`` a third of the way down the pane (pauses follow)."""
        self.unfollow()
        self._auto = True
        try:
            self.scroll_to(y=max(0, row - self.page // 3), animate=False)
        finally:
            self._auto = False
        self.refresh()
        self.check_window()

    def _scroll_end(self) -> None:
        self._auto = True
        try:
            self.scroll_to(y=max(0, self.total - self.page), animate=False, force=True)
        finally:
            self._auto = False

    def _set_virtual(self) -> None:
        width = self.scrollable_content_region.width
        if not self.wrap and self.window:
            width = max(width, self._gutter_w() + max(len(r.text) for r in self.window) + 1)
        self._auto = True
        try:
            self.virtual_size = Size(width, self.total)
        finally:
            self._auto = False

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if not self._auto and self.following and new < old and new < self.max_scroll_y - 0.5:
            self.following = False
            self.post_message(self.FollowChanged(False))
        self.check_window()

    def action_scroll_lines(self, amount: float) -> None:
        delta = int(amount) if abs(amount) >= 1 else int(amount * self.page)
        if delta < 0:
            self.unfollow()
        self.scroll_to(y=self.scroll_y + delta, animate=False)

    def action_scroll_cols(self, delta: int) -> None:
        if not self.wrap:
            self.scroll_to(x=max(0, self.scroll_x + delta), animate=False)

    def on_resize(self) -> None:
        self._set_virtual()
        if self.following:
            self._scroll_end()
        self.check_window()

    # ------------------------------------------------------------------------------ rendering
    def _gutter_w(self) -> int:
        return self.line_digits + 1

    def _body(self, row: Row) -> Text:
        text = row.text
        if self.hide_timestamps:
            text = TIMESTAMP_RE.sub("", text, count=1)
        t = Text(text, no_wrap=not self.wrap, overflow="fold", end="")
        if ERROR_RE.search(text):
            t.stylize(self.get_component_rich_style("logview--error", partial=True))
        elif WARNING_RE.search(text):
            t.stylize(self.get_component_rich_style("logview--warning", partial=True))
        if self.search is not None:
            t.highlight_regex(self.search, self.get_component_rich_style("logview--match", partial=True))
        return t

    def _gutter(self, row: Row | None, first_piece: bool) -> Segment:
        w = self._gutter_w()
        label = (
            f"{row.line + 1:>{w - 1}} "
            if row is not None and row.line is not None and first_piece
            else " " * w
        )
        return Segment(
            label[-w:] if len(label) > w else label, self.get_component_rich_style("logview--gutter")
        )

    def _base(self, row: Row | None) -> Style:
        if row is not None and row.line is not None and row.line == self.found_line:
            return self.rich_style + self.get_component_rich_style("logview--found", partial=True)
        return self.rich_style

    def _strip(
        self, row: Row | None, body: Text | None, first_piece: bool, width: int, scroll_x: int
    ) -> Strip:
        base = self._base(row)
        gutter = self._gutter(row, first_piece)
        body_w = max(0, width - gutter.cell_length)
        if body is None:
            pending = Segment(
                "…" if row is None and first_piece else "", self.get_component_rich_style("logview--pending")
            )
            return Strip([gutter, pending]).crop_extend(0, width, base)
        segs = [
            Segment(s.text, base + s.style if s.style else base, s.control)
            for s in body.render(self.app.console)
            if s.text != "\n"
        ]
        line = Strip(segs).crop_extend(scroll_x, scroll_x + body_w, base)
        return Strip([gutter, *line]).crop_extend(0, width, base)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        if self.wrap:
            return self._render_wrapped(y, width)
        index = self.visible_first() + y
        if index >= self.total:
            return Strip.blank(width, self.rich_style)
        row = self.row(index)
        scroll_x = int(self.scroll_x)
        key = (
            index,
            row.line if row else None,
            row.text if row else None,
            width,
            scroll_x,
            self.line_digits,
            self.hide_timestamps,
            self.search.pattern if self.search else None,
            row is not None and row.line == self.found_line,
            self.app.theme,
        )
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strip(row, self._body(row) if row else None, True, width, scroll_x)
            self._strips[key] = strip
        return strip

    def _render_wrapped(self, y: int, width: int) -> Strip:
        key = (
            self.visible_first(),
            int(self.scroll_y),
            self.following,
            self.total,
            self.window_first,
            id(self.window),
            len(self.window),
            width,
            self.page,
            self.hide_timestamps,
            self.search.pattern if self.search else None,
            self.found_line,
            self.app.theme,
            self.line_digits,
        )
        if key != self._layout_key:
            self._layout_key = key
            self._layout = self._wrap_layout(width)
        if y >= len(self._layout):
            return Strip.blank(width, self.rich_style)
        row, piece, first = self._layout[y]
        return self._strip(row, piece, first, width, 0)

    def _wrap_layout(self, width: int) -> list[tuple[Row | None, Text | None, bool]]:
        body_w = max(1, width - self._gutter_w())
        page = self.page

        def pieces(index: int) -> list[tuple[Row | None, Text | None, bool]]:
            row = self.row(index)
            if row is None:
                return [(None, None, True)]
            lines = self._body(row).wrap(self.app.console, body_w, overflow="fold") or [Text("")]
            return [(row, ln, i == 0) for i, ln in enumerate(lines)]

        at_end = self.following or self.scroll_y >= self.max_scroll_y
        out: list[tuple[Row | None, Text | None, bool]] = []
        if at_end:  # fill from the last row upwards
            index = self.total - 1
            while index >= 0 and len(out) < page:
                out[:0] = pieces(index)
                index -= 1
            return out[-page:]
        index = int(self.scroll_y)
        while index < self.total and len(out) < page:
            out.extend(pieces(index))
            index += 1
        return out[:page]
