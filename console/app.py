"""The Aerie console: a Textual app whose main screen is the live stage board.

Data flows one way: the run model polls the transport (in a worker, never blocking the UI loop)
and the widgets redraw from the model. Operator actions (pause, kill, retry...) go to the
transport's ``ctl``, which runs ``pipeline.ctl`` on the executing host; the supervisor there acts
on the recorded process group and the result comes back as a notification. Quitting the console
never stops a stage: ``aerie attach RUN`` shows the same run, live.
"""

from __future__ import annotations

import contextlib
import time

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.color import Color, ColorParseError
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import Footer, Input, Static

from console.model import RunModel, StageView
from console.screens.dialogs import ConfirmScreen, HelpScreen
from console.screens.logview import LogScreen
from console.transport import Transport
from console.widgets.board import StageBoard
from console.widgets.detail import StageDetail
from console.widgets.meters import MetersPanel

# Theme variables a theme may set per state (``state-running`` ...); else these fall-backs.
STATE_FALLBACK = {
    "running": "primary", "starting": "primary", "ready": "success", "pausing": "warning", "paused": "warning",
    "succeeded": "success", "failed": "error", "killed": "error", "upstream-failed": "error",
    "unhealthy": "error", "pending": "foreground-muted", "skipped": "foreground-muted",
}
STALE_SUPERVISOR_S = 15.0


class AerieApp(App[int]):
    TITLE = "Aerie"
    CSS = """
    #header { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    #status-line { height: 1; padding: 0 1; color: $text-muted; }
    #filter { display: none; height: 3; }
    #filter.visible { display: block; }
    #main { height: 1fr; }
    #bottom { height: 14; border-top: solid $panel-lighten-2; }
    #meters { width: 50; border-left: solid $panel-lighten-2; }
    """
    BINDINGS = [
        Binding("p", "pause", "Pause/resume"),
        Binding("k", "kill", "Kill"),
        Binding("r", "retry", "Retry"),
        Binding("R", "retry_fresh", "Retry fresh", show=False),
        Binding("s", "skip", "Skip", show=False),
        Binding("l", "log", "Log"),
        Binding("slash", "filter", "Filter"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit_console", "Quit"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]
    HELP_ROWS = [
        ("↑/↓", "select a stage"),
        ("p", "pause the selected stage at its next safe point (SIGSTOP after the grace period); again to resume"),
        ("k", "kill: SIGTERM to the stage's recorded process group, SIGKILL after the grace (asks first)"),
        ("r", "retry a failed/killed/skipped stage; it resumes from what is already done"),
        ("R", "retry from scratch: clears the stage's outputs in the run dir first (asks first)"),
        ("s", "skip a stage that has not started (its dependants treat it as done)"),
        ("l", "full log of the selected stage"),
        ("/", "filter stages by id or state; Esc clears"),
        ("ctrl+p", "command palette (every action, themes)"),
        ("?", "this help"),
        ("q", "quit the console — stages keep running; `aerie attach RUN` re-attaches"),
    ]

    def __init__(self, transport: Transport, poll_s: float = 1.0, theme: str | None = None) -> None:
        super().__init__()
        self.transport = transport
        self.model = RunModel(transport)
        self.poll_s = poll_s
        self._theme_name = theme
        self._styles: dict[str, str] = {}
        self._log_screen: LogScreen | None = None
        self._shown: dict[str, object] = {}

    # ------------------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static("Aerie", id="header")
        yield Input(placeholder="filter stages (id or state) — Enter to apply, Esc to clear", id="filter")
        with Vertical(id="main"):
            yield StageBoard(id="board")
            with Horizontal(id="bottom"):
                yield StageDetail(id="detail")
                yield MetersPanel(self.model.telemetry, id="meters")
        yield Static("", id="status-line")
        yield Footer()

    def on_mount(self) -> None:
        if self._theme_name:
            self.theme = self._theme_name
        self.query_one(StageBoard).focus()
        self.poll_model()
        self.set_interval(self.poll_s, self.poll_model)
        self.ensure_supervisor()

    # ------------------------------------------------------------------------------ theme
    def watch_theme(self, _theme: str) -> None:
        self._styles.clear()
        with contextlib.suppress(NoMatches):  # not composed yet
            self.refresh_view({"*"})

    def state_style(self, state: str) -> str:
        if state not in self._styles:
            v = self.get_css_variables()
            raw = v.get(f"state-{state}") or v.get(STATE_FALLBACK.get(state, "foreground"), "")
            try:
                color = Color.parse(raw)
            except ColorParseError:
                color = Color.parse(v.get("foreground", "white"))
            if color.a < 1:  # Rich has no alpha: blend onto the background as the terminal would show it
                color = Color.parse(v.get("background", "black")).blend(color.with_alpha(1), color.a)
            bold = state in ("failed", "killed", "upstream-failed", "unhealthy")
            self._styles[state] = f"{'bold ' if bold else ''}{color.hex6}"
        return self._styles[state]

    # ------------------------------------------------------------------------------ polling
    @work(exclusive=True, group="poll")
    async def poll_model(self) -> None:
        changed = await self.model.poll()
        self.refresh_view(changed)

    def refresh_view(self, changed: set[str]) -> None:
        ticking = any(s.state in ("running", "paused") for s in self.model.stages.values())
        if not changed and not ticking and self.model.loaded:
            return  # nothing new and no elapsed clock to advance
        board = self.query_one(StageBoard)
        board.sync(self.model)
        self._update_header()
        meters = self.query_one(MetersPanel)
        if meters.display != (self.model.telemetry_stage is not None):
            meters.display = self.model.telemetry_stage is not None  # no telemetry stage: no empty meters
        detail = self.query_one(StageDetail)
        st = board.selected_stage(self.model)
        self.model.watch_log(st.id if st else None)
        if st is not None and (st.id != detail.stage_id):
            detail.show(st)
        elif st is not None and (st.id in changed or "*" in changed or st.state in ("running", "paused")):
            detail.sync(st)
        if self._log_screen is not None and self._log_screen.is_attached:
            s = self.model.stages.get(self._log_screen.stage_id)
            if s is not None:
                new = s.log_total - getattr(self._log_screen, "seen", 0)
                if new > 0:
                    self._log_screen.append(list(s.log)[-min(new, len(s.log)):])
                self._log_screen.seen = s.log_total  # type: ignore[attr-defined]

    def _update_header(self) -> None:
        m = self.model
        t = Text()
        t.append(f" {m.run_name or 'Aerie'} ", style="bold")
        t.append(f" {self.transport.status.label()} ")
        t.append(f" {m.run_dir} ", style="dim")
        for state, n in sorted(m.counts().items()):
            t.append(f" {n} {state} ", style=self.state_style(state))
        self._set_text("#header", t)
        line = Text()
        if m.error:
            line.append(m.error, style=self.state_style("failed"))
        elif not m.loaded:
            line.append("waiting for the supervisor's first snapshot…")
        elif m.done:
            ok = m.all_succeeded()
            line.append("run finished: " + ("every stage succeeded" if ok else "some stages did not succeed"),
                        style=self.state_style("succeeded" if ok else "failed"))
        elif m.supervisor_t and time.time() - m.supervisor_t > STALE_SUPERVISOR_S:
            line.append(f"supervisor silent for {time.time() - m.supervisor_t:.0f}s — restarting it",
                        style=self.state_style("paused"))
        else:
            line.append(f"supervisor pid {m.supervisor_pid} · polling every {self.poll_s:g}s")
        self._set_text("#status-line", line)

    def _set_text(self, selector: str, text: Text) -> None:
        """Update a one-line Static only when its text changed."""
        key = (text.plain, tuple((sp.start, sp.end, str(sp.style)) for sp in text.spans))
        if self._shown.get(selector) != key:
            self._shown[selector] = key
            self.query_one(selector, Static).update(text, layout=False)

    @on(StageBoard.Highlighted)
    def _row_changed(self, _event: StageBoard.Highlighted) -> None:
        st = self.query_one(StageBoard).selected_stage(self.model)
        self.model.watch_log(st.id if st else None)
        self.query_one(StageDetail).show(st)
        if st is not None:
            self.poll_model()

    # ------------------------------------------------------------------------------ actions
    def _selected(self) -> StageView | None:
        st = self.query_one(StageBoard).selected_stage(self.model)
        if st is None:
            self.notify("select a stage first (a family row is a group)", severity="warning")
        return st

    @work(group="ctl")
    async def run_ctl(self, action: str, stage_id: str, *extra: str) -> None:
        res = await self.transport.ctl(action, stage_id, *extra)
        if res.returncode == 0:
            self.notify(res.message or f"{action} {stage_id}: done", title=action)
        else:
            self.notify(res.message or f"{action} {stage_id} failed (exit {res.returncode})", title=action,
                        severity="error", timeout=8)
        self.poll_model()

    @work(group="ctl")
    async def ensure_supervisor(self) -> None:
        await self.transport.ctl("ensure")

    def action_pause(self) -> None:
        st = self._selected()
        if st is None:
            return
        if st.state == "paused" or st.pausing:
            self.run_ctl("resume", st.id)
        elif st.state == "running":
            self.run_ctl("pause", st.id)
        else:
            self.notify(f"{st.id} is {st.display_state}: only a running stage can be paused", severity="warning")

    def action_kill(self) -> None:
        st = self._selected()
        if st is None:
            return
        if st.state not in ("running", "paused"):
            self.notify(f"{st.id} is {st.display_state}: nothing to kill", severity="warning")
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.run_ctl("kill", st.id)

        self.push_screen(ConfirmScreen(
            f"Kill {st.id}?\n\nSIGTERM to its process group {st.pgid} (pid {st.pid}), SIGKILL after the "
            "grace period. Its children die too; nothing else is touched."), done)

    def action_retry(self) -> None:
        st = self._selected()
        if st is not None:
            self.run_ctl("retry", st.id)

    def action_retry_fresh(self) -> None:
        st = self._selected()
        if st is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.run_ctl("retry", st.id, "--fresh")

        self.push_screen(ConfirmScreen(f"Retry {st.id} from scratch?\n\nIts outputs in the run directory "
                                       f"(stages/{st.id}/out) are deleted first."), done)

    def action_skip(self) -> None:
        st = self._selected()
        if st is not None:
            self.run_ctl("skip", st.id)

    def action_log(self) -> None:
        st = self._selected()
        if st is None:
            return
        screen = LogScreen(st.id, list(st.log))
        screen.seen = st.log_total  # type: ignore[attr-defined]
        self._log_screen = screen
        self.push_screen(screen)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("visible")
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        board = self.query_one(StageBoard)
        board.filter_text = event.value.strip()
        board.sync(self.model)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, _event: Input.Submitted) -> None:
        self.query_one(StageBoard).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.remove_class("visible")
        self.query_one(StageBoard).focus()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.HELP_ROWS, notes="Closing the console never stops a stage."))

    def action_quit_console(self) -> None:
        self.exit(0, message=f"Aerie console closed; the run keeps going.\nRe-attach: aerie attach {self.model.run_dir}")
