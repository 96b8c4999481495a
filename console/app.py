"""The Aerie console: a Textual app whose main screen is the live stage board.

Data flows one way: the run model polls the transport (in a worker, never blocking the UI loop)
and the widgets redraw from the model. Operator actions (pause, kill, retry...) go to the
transport's ``ctl``, which runs ``pipeline.run.supervise.ctl`` on the executing host; the supervisor there acts
on the recorded process group and the result comes back as a notification. Quitting the console
never stops a stage: ``aerie attach RUN`` shows the same run, live.

Around the board: the full log of any stage (``l``; the inference server's with ``L``) in the log
viewer, the per-dataset progress screen (``d``), the metrics' curves (``m``; a compact loss/acc_0
plot in the detail pane of a training stage), themes from ``themes/`` (``--theme``, the user's
config, the plan's ``[ui]``, or the command palette), the run's alerts, raised on the executing host and
read from its records (a toast and the bell for each one raised while attached, :mod:`console.alert_dispatch`;
``a`` lists them all, Enter selects the alerted stage; ``K`` acknowledges and ``S`` silences one, on the board
the selected stage's, in the list the highlighted one), every action in the command palette
(``ctrl+p``) and ``?`` listing every key of the screen it is pressed on.

Every action is sent with the front end (``via``: console, or browser under ``aerie serve``) and the
operator (``user@host``) for the run's audit log (``A`` shows it; :mod:`pipeline.run.rundir.audit`). A
read-only console (``aerie attach --read-only``, a view token of ``aerie serve``) shows everything,
hides the control keys from the footer and answers each of them with a "read-only: ..."
notification; nothing is sent (it does not even start a missing supervisor: it says so).

The supervisor's liveness (:mod:`console.sup_watch`): when its snapshot stops moving the app asks the host
through the transport (``ctl ensure``, which restarts a dead supervisor, at any time and not only on attach)
and the status line says whether it is silent (alive, cannot write) or dead and being restarted; its open
alerts (a write that fails, a damaged stage file) are shown there too and notified once.

Every action's key, words, confirmation, ctl verb and read-only refusal are one table,
:mod:`console.actions`: the bindings, the palette's entries and the help sheet's lines are generated from
it, and the methods here only say what each action does to the selected stage. Over 450 lines because it is
the App itself (layout, polling, one short method per action); what has a job of its own lives beside it
(header text: ``console.header``; alerts: ``console.alert_dispatch``; each screen's palette entries:
``console.palette``; screens and widgets).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from rich.text import Text
from textual import events, on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.color import Color, ColorParseError
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.geometry import Size
from textual.screen import Screen
from textual.theme import BUILTIN_THEMES
from textual.widgets import Footer, Input, Static
from textual.widgets._footer import FooterKey

from console.actions import (
    ACTION,
    ACTIONS,
    CONTROL_NAMES,
    ConsoleAction,
    bindings,
    palette_entries,
    refusal,
    wrong_state,
)
from console.alert_dispatch import AlertDispatcher
from console.audit_trail import AuditTrail
from console.compare import OtherRun
from console.header import ProjectionLine, header_text, plan_of, status_text
from console.logindex import LogIndex
from console.model import RunModel, StageView
from console.palette import screen_commands
from console.screens.alerts import AlertsScreen
from console.screens.audit import AuditScreen
from console.screens.datasets import DatasetsScreen
from console.screens.dialogs import ConfirmScreen, HelpScreen, binding_rows, help_sections
from console.screens.logview import LogScreen
from console.screens.metrics import MetricsScreen
from console.settings import Settings, read_user_config, resolve, user_config_path
from console.states import look
from console.sup_watch import SupervisorWatch, open_alerts, rows_without_supervisor
from console.transport import Transport
from console.widgets.board import GROUP_PREFIX, StageBoard
from console.widgets.detail import StageDetail
from console.widgets.meters import MetersPanel
from pipeline.run.alerts.record import AlertRecord
from pipeline.run.plan.dag import Plan
from pipeline.run.rundir import audit
from pipeline.run.rundir.stage_row import SATISFIED, TERMINAL, HealthState, StageState
from pipeline.run.supervise.force_text import force_message
from themes import load_themes


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (CSS, widgets, themes) out of the cyclic GC's reach.

    Full collections then scan only what was allocated since; on a busy 2-core host they were the
    longest UI stalls while a log streamed (measured in bench/log_ingest.py).
    """
    gc.collect()
    gc.freeze()


class KeyFooter(Footer):
    """The footer, with ``?`` (help) and ``q`` (quit) first: a narrow terminal cuts the footer's end, and
    those two are the keys an operator must always find (k9s, htop keep them in view the same way)."""

    FIRST = ("help", "quit_console")

    def compose(self) -> ComposeResult:
        items = list(super().compose())
        first = [w for w in items if isinstance(w, FooterKey) and w.action in self.FIRST]
        first.sort(key=lambda w: self.FIRST.index(w.action))
        yield from first + [w for w in items if w not in first]


def most_relevant(model: RunModel) -> str | None:
    """The stage to show first on attach (lazygit opens on a selection): the latest failure, else a stage with
    an open alert, else a running stage (a work stage before a service), else the work stage that finished last
    (a service stopped at the run's end says less), else the first waiting one (a run whose stages have not
    started yet): never nothing while the run has a stage."""
    alerted = set(model.alerts.open_stages())
    return most_relevant_of([model.stages[sid] for sid in model.order if sid in model.stages], alerted)


def most_relevant_of(stages: list[StageView], alerted: set[str] | frozenset[str] = frozenset()) -> str | None:
    """:func:`most_relevant` among ``stages`` (a run's, or one family's), in plan order; ``alerted``: the stages
    with an open alert."""
    broken = [
        s
        for s in stages
        if s.state in (StageState.FAILED, StageState.KILLED) or s.health == HealthState.UNHEALTHY
    ]
    if broken:
        return max(broken, key=lambda s: s.finished_at or 0.0).id
    if flagged := [s for s in stages if s.id in alerted]:
        return flagged[0].id
    live = [s for s in stages if s.state in (StageState.RUNNING, StageState.PAUSED) or s.pausing]
    if live:  # a work stage, else a service (the telemetry stage last: its meters are on screen already)
        return min(live, key=lambda s: (s.service, s.run == "telemetry")).id
    ended = [s for s in stages if s.finished_at]
    if ended:
        return max(ended, key=lambda s: (not s.service, s.finished_at or 0.0)).id
    waiting = [s for s in stages if s.state not in TERMINAL]  # nothing started yet: the next to run
    return (waiting or stages)[0].id if stages else None


def force_plan(st: StageView, stages: Mapping[str, StageView]) -> str:
    """What ``F`` on ``st`` will do and when, as the supervisor will answer (pipeline/run/supervise/force_text.py),
    from typed data: the dependencies in the row's ``after`` whose snapshot state is not done yet. While there
    are some, the row's ``reason`` says no more than they do; once there are none, it is what else holds the
    stage (a service, CPU/GPU slots, an admission check) and is quoted."""
    waiting = [
        (d, str(ds.state) if ds else "unknown")
        for d in st.after
        if (ds := stages.get(d)) is None or ds.state not in SATISFIED
    ]
    return force_message(st.id, st.attempt, waiting, "" if waiting else st.reason, armed="will be armed")


class AerieApp(App[int]):
    TITLE = "Aerie"
    CSS = """
    #header { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    #status-line { height: 1; padding: 0 1; color: $text-muted; }
    #projection { height: 1; padding: 0 1; background: $panel; color: $text-muted; }
    #filter { display: none; height: 3; }
    #filter.visible { display: block; }
    #main { height: 1fr; }
    #board { height: auto; overflow-x: hidden; }
    #bottom { height: 1fr; border-top: solid $panel-lighten-2; }
    #meters { border-top: solid $panel-lighten-2; }
    AerieApp.-wide StageDetail #info { width: 56; }
    AerieApp.-narrow StageDetail { layout: vertical; }
    AerieApp.-narrow StageDetail #info { width: 1fr; height: auto; max-height: 14; }
    AerieApp.-narrow StageDetail #events { height: auto; max-height: 4; }
    AerieApp.-narrow StageDetail #plot-in { height: 8; }
    AerieApp.-narrow StageDetail Log { height: 1fr; border-left: none; border-top: solid $panel-lighten-2; }
    AerieApp.-narrow.-short StageDetail Log { display: none; }
    AerieApp.-narrow.-short StageDetail #info { height: 1fr; max-height: 100%; }
    AerieApp.-narrow.-short StageDetail #events { height: 1fr; max-height: 100%; }
    ToastRack { dock: bottom; align: right bottom; margin-bottom: 2; max-height: 45%; }
    MetricsScreen ToastRack { dock: bottom; align: left bottom; margin-bottom: 2; max-height: 100%; }
    MetricsScreen ToastHolder { align-horizontal: left; }
    MetricsScreen Toast { width: 29; max-width: 29; }
    """
    # Layout by terminal size (see docs/operating.md, "Layout"): the board is as tall as its rows (up to
    # what leaves the meters and the detail pane their room), the meters always span the full width
    # under it (a GPU row never shares its line) and the detail pane takes the rest. Toasts sit at the
    # bottom right, over the detail pane's log tail, above the status line: never over the board, whose
    # note column holds the failure's cause (alerts last seconds there; ``a`` lists them all). The metrics
    # view keeps them over its metric list.
    WIDE_COLS = 170  # the detail's plot gets a column of its own (narrower, it sits under the facts)
    NARROW_COLS = 100  # the detail's log goes under the facts (or, on a short terminal, behind `l`)
    TINY_ROWS = 30  # smallest detail pane, the meters in 3 lines: the board's rows first (80x24)
    SHORT_ROWS = 36  # smaller detail pane
    TALL_ROWS = 50  # larger detail pane
    BOARD_MIN_ROWS = 12  # GPUs become cells of a grid (several per line) when a row each would leave fewer
    BOARD_FLOOR = 6  # the board's least height (its header and 5 stages) however short the terminal
    BINDINGS = bindings()  # the action table's (console/actions.py), with a read-only console's refusals

    def __init__(
        self,
        transport: Transport,
        poll_s: float = 1.0,
        theme: str | None = None,
        alerts: bool = True,
        user_config: dict | None = None,
        read_only: bool = False,
        via: str = "console",
        compare: list[OtherRun] | None = None,
    ) -> None:
        super().__init__()
        self.compare_runs = compare or []  # other runs the metrics view overlays (console.compare)
        self.transport = transport
        self.read_only = read_only
        self.via = via
        self.operator = audit.identity()
        self.audit_trail = AuditTrail(transport)
        self.model = RunModel(transport)
        self.poll_s = poll_s
        self.themes = load_themes()
        for t in self.themes.values():
            self.register_theme(t)
        self._cli_theme = theme
        if user_config is None:
            user_config, problems = read_user_config()
        else:
            problems = []
        self._user_config = user_config
        self.settings: Settings = self._resolve({})
        self.settings.problems[:0] = problems
        self.alerts_enabled = alerts
        self.alerts = AlertDispatcher(self)  # the run's alert records, announced (console.alert_dispatch)
        self._styles: dict[str, str] = {}
        self._shown: dict[str, object] = {}
        self.sup_watch = SupervisorWatch(read_only)
        self._sup_line: tuple[str, str] | None = None
        self._sup_alerts_seen: set[tuple[str, float]] = set()
        self.plan: Plan | str | None = None  # the run's frozen plan, for the projection line (or why not)
        self._board_cap = 0  # the board's most rows (see _meters_layout)
        self._size: Size | None = None
        self.projection = ProjectionLine()
        # Until the operator moves the cursor, the board keeps the stage most worth a look selected (from the
        # first snapshot on: a run whose stages all wait still selects the next to run).
        self._auto_select = True
        self._auto_key: str | None = None  # what it selected last (another selection: the operator moved)

    def _resolve(self, plan_raw: dict) -> Settings:
        return resolve(
            self._cli_theme,
            self._user_config,
            str(user_config_path()),
            plan_raw,
            f"{self.transport.run_root}/plan.toml",
            [*self.themes, *BUILTIN_THEMES],
        )

    # ------------------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static("Aerie", id="header")
        yield Static("", id="projection")
        yield Input(placeholder="filter stages (id or state) — Enter to apply, Esc to clear", id="filter")
        with Vertical(id="main"):
            yield StageBoard(id="board")
            yield MetersPanel(self.model.telemetry, id="meters")
            with Horizontal(id="bottom"):
                yield StageDetail(id="detail")
        yield Static("", id="status-line")
        yield KeyFooter()

    def on_resize(self, event: events.Resize) -> None:
        self._size = event.size  # self.size still has the old one here
        self._apply_layout()
        with contextlib.suppress(NoMatches):
            self._update_header()

    @property
    def layout_size(self) -> Size:
        """The terminal's size for the layout rules: the latest resize's (``self.size`` lags it)."""
        return self._size or self.size

    def _apply_layout(self) -> None:
        w, h = self.layout_size
        self.set_class(w >= self.WIDE_COLS, "-wide")
        self.set_class(w < self.NARROW_COLS, "-narrow")
        self.set_class(h < self.SHORT_ROWS, "-short")
        self.set_class(h >= self.TALL_ROWS, "-tall")
        with contextlib.suppress(NoMatches):
            self._meters_layout()
            detail = self.query_one(StageDetail)
            st = self.model.stages.get(detail.stage_id or "")
            if st is not None:
                detail.sync(st)

    def bottom_min(self) -> int:
        """The detail pane's least height: 6 rows under 30 rows of terminal (the board's rows come first),
        10 under 36, 14, or 18 from 50 rows."""
        h = self.layout_size.height
        if h < self.TINY_ROWS:
            return 6
        return 10 if h < self.SHORT_ROWS else (18 if h >= self.TALL_ROWS else 14)

    def _meters_layout(self) -> None:
        w, h = self.layout_size
        bottom = self.bottom_min()
        rows_each = len(self.model.telemetry.gpus) + 4  # title, a row per GPU, disk, host, border
        meters = self.query_one(MetersPanel)
        compact = h - 3 - bottom - rows_each < self.BOARD_MIN_ROWS
        tiny = h < self.TINY_ROWS  # the GPUs as one summary line in the title, no host line
        meters.set_compact(compact, tiny)
        # The board grows with its rows up to what leaves the meters and the detail pane their room.
        per_line = max(1, (w - 2) // 30)  # the grid's cells (GpuGrid.CELL_W) on a line
        gpu_lines = -(-len(self.model.telemetry.gpus) // per_line) if compact else rows_each - 4
        meters_h = (3 if tiny else gpu_lines + 4) if meters.display else 0
        cap = max(self.BOARD_FLOOR, h - 4 - meters_h - bottom)
        board = self.query_one(StageBoard)
        if cap != self._board_cap:
            self._board_cap = cap
            board.styles.max_height = cap
        if board.room != cap - 1:  # families fold by themselves when their rows would not fit
            board.room = cap - 1
            if self.model.loaded:
                board.sync(self.model)

    def on_mount(self) -> None:
        self._apply_layout()
        self.theme = self.settings.theme
        self.query_one(StageBoard).focus()
        self.poll_model()
        self.set_interval(self.poll_s, self.poll_model)
        self.ensure_supervisor()
        self.load_plan_settings()
        self.call_after_refresh(freeze_startup_objects)

    @work(group="settings")
    async def load_plan_settings(self) -> None:
        """The plan's [ui] and [alerts], read through the transport (the plan lives in the run dir)."""
        try:
            res = (await self.transport.read_many([("plan.toml", 0)], max_bytes=4 << 20))[0]
            raw = tomllib.loads(res.data.decode()) if res.size > 0 else {}
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raw = {}
            self.settings.problems.append(f"{self.transport.run_root}/plan.toml: {exc}")
        except Exception:  # unreachable for now: the user's settings stand
            raw = {}
        problems = self.settings.problems
        self.settings = self._resolve(raw)
        self.plan = plan_of(raw, self.transport.run_root) if raw else None
        self.settings.problems[:0] = [p for p in problems if p not in self.settings.problems]
        if self.theme != self.settings.theme and self.settings.theme_from not in ("default",):
            self.theme = self.settings.theme
        for p in self.settings.problems:
            self.notify(p, title="settings", severity="warning", timeout=10)

    # ------------------------------------------------------------------------------ theme
    def watch_theme(self, _theme: str) -> None:
        self._styles.clear()
        with contextlib.suppress(NoMatches):  # not composed yet
            self.refresh_view({"*"})

    def state_style(self, state: str) -> str:
        if state not in self._styles:
            v = self.get_css_variables()
            # A theme may set state-<name> (``state-running`` ...); else the state's fall-back colour.
            raw = v.get(f"state-{state}") or v.get(look(state).colour, "")
            try:
                color = Color.parse(raw)
            except ColorParseError:
                color = Color.parse(v.get("foreground", "white"))
            if color.a < 1:  # Rich has no alpha: blend onto the background as the terminal would show it
                color = Color.parse(v.get("background", "black")).blend(color.with_alpha(1), color.a)
            bold = look(state).bold
            self._styles[state] = f"{'bold ' if bold else ''}{color.hex6}"
        return self._styles[state]

    # ------------------------------------------------------------------------------ polling
    @work(exclusive=True, group="poll")
    async def poll_model(self) -> None:
        changed = await self.model.poll()
        changed |= self._watch_supervisor()
        with self.batch_update():  # one screen update per poll, not one per widget that changed
            self.refresh_view(changed)

    def refresh_view(self, changed: set[str]) -> None:
        ticking = any(s.state in (StageState.RUNNING, StageState.PAUSED) for s in self.model.stages.values())
        if not changed and not ticking and self.model.loaded:
            return  # nothing new and no elapsed clock to advance
        try:
            board = self.query_one(StageBoard)
        except NoMatches:
            return  # a poll that finished while the app is closing (or before it composed): nothing to draw

        board.sync(self.model)
        note = "" if self.model.loaded else self.model.waiting_for
        if note != board.empty_note:
            board.empty_note = note
            board.refresh()
        if self._auto_select and self.model.loaded:
            self._follow_most_relevant(board)
        self._update_header()
        meters = self.query_one(MetersPanel)
        if meters.display != (self.model.telemetry_stage is not None):
            meters.display = self.model.telemetry_stage is not None  # no telemetry stage: no empty meters
            self._meters_layout()  # the board's room changed
        if "telemetry" in changed:
            self._meters_layout()
        detail = self.query_one(StageDetail)
        st = self._detail_stage(board, detail)
        self.model.watch_log(st.id if st else None)
        if st is not None and (st.id != detail.stage_id):
            detail.show(st)
        elif st is not None and (
            st.id in changed or "*" in changed or st.state in (StageState.RUNNING, StageState.PAUSED)
        ):
            detail.sync(st)
        screen = self.screen
        if isinstance(screen, DatasetsScreen | MetricsScreen):
            screen.sync(self.model)
        elif isinstance(screen, AlertsScreen) and "alerts" in changed:
            screen.sync(self.model.alerts.ordered())
        if self.alerts_enabled and self.model.loaded:
            self.alerts.check(self.model)

    def _detail_stage(self, board: StageBoard, detail: StageDetail) -> StageView | None:
        """The stage the detail pane shows: the selected one; on a family's row, that family's stage most worth
        a look (said above its facts), never an empty pane."""
        st = board.selected_stage(self.model)
        fam = board.family_of(board.selected_key) if st is None else None
        members = [m for f, ms in self.model.families() if f == fam for m in ms]
        pick = most_relevant_of(members, set(self.model.alerts.open_stages())) if members else None
        detail.family_note = (
            f"family {fam} ({len(members)} stages) — its stage most worth a look; ↓ selects one"
            if pick
            else ""
        )
        return self.model.stages.get(pick) if pick else st

    def _follow_most_relevant(self, board: StageBoard) -> None:
        if (
            self._auto_key is not None
            and board.selected_key != self._auto_key
            and not self._folded_away(board)
        ):
            self._auto_select = False  # the operator chose: the board is theirs
            return
        sid = most_relevant(self.model)
        if sid is not None and sid != board.selected_key:
            board.select_key(sid, unfold=False)  # folded away: its family's row, which shows it in the detail
        self._auto_key = board.selected_key

    def _folded_away(self, board: StageBoard) -> bool:
        """The board itself moved the cursor: the stage the console had selected was folded into its family
        (its family ended and folded to fit), so the cursor went to the family's row — not the operator's move."""
        key = self._auto_key
        fam = board.family_of(key)
        return (
            key is not None
            and not board.shows(key)
            and fam is not None
            and board.selected_key == GROUP_PREFIX + fam
        )

    def _update_header(self) -> None:
        style = self.state_style
        self._set_text("#projection", self.projection.text(self.model, self.plan, self.size.width))
        header = header_text(self.model, self.transport.status.label(), self.size.width, style)
        if self.read_only:
            header = Text.assemble(("READ-ONLY ", "bold reverse"), header)
        self._set_text("#header", header)
        self._set_text("#status-line", status_text(self.model, self.poll_s, style, watch=self.sup_watch))

    def _set_text(self, selector: str, text: Text) -> None:
        """Update a one-line Static only when its text changed."""
        key = (text.plain, tuple((sp.start, sp.end, str(sp.style)) for sp in text.spans))
        if self._shown.get(selector) != key:
            self._shown[selector] = key
            self.query_one(selector, Static).update(text, layout=False)

    @on(StageBoard.Highlighted)
    def _row_changed(self, _event: StageBoard.Highlighted) -> None:
        try:
            detail = self.query_one(StageDetail)
            st = self._detail_stage(self.query_one(StageBoard), detail)
        except NoMatches:
            return  # the console is closing: its board is gone
        self.model.watch_log(st.id if st else None)
        detail.show(st)
        if st is not None:
            self.poll_model()

    # ------------------------------------------------------------------------------ actions
    def _selected(self) -> StageView | None:
        """The stage an action applies to: the dataset screen's or log screen's, else the board's."""
        sid = getattr(self.screen, "selected_stage_id", None)
        st = self.model.stages.get(sid) if sid else self.query_one(StageBoard).selected_stage(self.model)
        if st is None:
            self.notify("select a stage first (a family row is a group)", severity="warning")
        return st

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A read-only console: the control bindings are off (hidden from the footer), the refusals on."""
        if action in CONTROL_NAMES:
            return not self.read_only
        if action == "read_only":
            return self.read_only
        return True

    def refuse_read_only(self, action: str) -> bool:
        """True (after saying so, in the action table's words) when this console is read-only: the caller
        sends nothing."""
        if self.read_only:
            sid = getattr(self.screen, "selected_stage_id", None)
            with contextlib.suppress(NoMatches):
                st = None if sid else self.query_one(StageBoard).selected_stage(self.model)
                sid = st.id if st else sid
            self.notify(refusal(action, sid), title="read-only", severity="warning")
        return self.read_only

    def action_read_only(self, action: str) -> None:
        self.refuse_read_only(action)

    def _control_target(self, action: ConsoleAction) -> StageView | None:
        """The stage a control action applies to, or None after saying why not (read-only, none selected)."""
        return None if self.refuse_read_only(action.name) else self._selected()

    def _wrong_state(self, action: ConsoleAction, st: StageView) -> None:
        self.notify(wrong_state(action.name, st.id, st.display_state), severity="warning")

    def _confirm_then_send(self, action: ConsoleAction, st: StageView, **facts: object) -> None:
        """Ask the table's question about ``st``; a yes sends the action."""

        def done(yes: bool | None) -> None:
            if yes:
                self.run_ctl(action, st.id)

        self.push_screen(ConfirmScreen(action.question(id=st.id, **facts)), done)

    @work(group="ctl")
    async def run_ctl(self, action: ConsoleAction, stage_id: str, verb: str = "") -> None:
        """Send ``action`` (its first verb, or ``verb``) for ``stage_id``, with its flags, and say the outcome."""
        if self.refuse_read_only(action.name):
            return
        verb = verb or action.sends[0]
        res = await self.transport.ctl(
            verb, stage_id, *action.flags, "--via", self.via, "--who", self.operator
        )
        if res.returncode == 0:
            self.notify(res.message or f"{verb} {stage_id}: done", title=verb)
        else:
            self.notify(
                res.message or f"{verb} {stage_id} failed (exit {res.returncode})",
                title=verb,
                severity="error",
                timeout=8,
            )
        self.poll_model()

    @work(group="ctl")
    async def ensure_supervisor(self) -> None:
        if self.read_only:  # a watcher changes nothing, not even a missing supervisor: it asks, and says
            rep = await self.sup_watch.check(self.transport)
            if rep.get("verdict") in ("dead", "finished") and not self.model.loaded:
                await rows_without_supervisor(self.model, self.transport)
            self.poll_model()
        else:
            rep = await self.sup_watch.check(self.transport)
            # A supervisor that died mid-run (before we attached, or between attaching and this answer: under
            # load the check lands late) is news; starting one for a finished run, or a run whose supervisor
            # never wrote a snapshot, is not.
            if rep.get("verdict") == "dead" and rep.get("last_seen") is not None:
                self._said_restart(rep)

    def _said_restart(self, rep: dict[str, Any]) -> None:
        """A check of the host that started a supervisor says so, whichever check it was (the one on attach
        may land after the supervisor died: it is then the one that restarts it)."""
        if rep.get("started"):
            self.notify(f"{rep.get('text')}: started a new one", title="supervisor", severity="warning")

    def _watch_supervisor(self) -> set[str]:
        """After each poll: a stale snapshot makes the host be asked (and a dead supervisor restarted);
        returns {"supervisor"} when the status line's words about it changed."""
        watch = self.sup_watch
        watch.observe(self.model.supervisor_t)
        if watch.due(self.model.done):
            watch.checking = True  # until the worker has asked
            self.check_supervisor()
        for a in open_alerts(self.model.supervisor_alerts):
            key = (str(a.get("code")), float(a.get("since") or 0))
            if key not in self._sup_alerts_seen:
                self._sup_alerts_seen.add(key)
                self.notify(str(a.get("text", "")), title="supervisor alert", severity="warning", timeout=10)
        line = watch.line(self.model.done)
        if line != self._sup_line:
            self._sup_line = line
            return {"supervisor"}
        return set()

    @work(group="liveness")
    async def check_supervisor(self) -> None:
        self._said_restart(await self.sup_watch.check(self.transport))
        self.poll_model()

    def action_pause(self) -> None:
        action = ACTION["pause"]
        st = self._control_target(action)
        if st is None:
            return
        if st.state == StageState.PAUSED or st.pausing:
            self.run_ctl(action, st.id, "resume")
        elif st.state == StageState.RUNNING:
            self.run_ctl(action, st.id)
        else:
            self._wrong_state(action, st)

    def action_kill(self) -> None:
        action = ACTION["kill"]
        st = self._control_target(action)
        if st is None:
            return
        if st.state not in (StageState.RUNNING, StageState.PAUSED):
            self._wrong_state(action, st)
            return
        self._confirm_then_send(action, st, pgid=st.pgid, pid=st.pid)

    def action_retry(self) -> None:
        st = self._control_target(ACTION["retry"])
        if st is not None:
            self.run_ctl(ACTION["retry"], st.id)

    def action_retry_fresh(self) -> None:
        st = self._control_target(ACTION["retry_fresh"])
        if st is not None:
            self._confirm_then_send(ACTION["retry_fresh"], st)

    def action_skip(self) -> None:
        st = self._control_target(ACTION["skip"])
        if st is not None:
            self.run_ctl(ACTION["skip"], st.id)

    def action_force(self) -> None:
        action = ACTION["force"]
        st = self._control_target(action)
        if st is None:
            return
        if st.forced:  # armed already: F again disarms it (as p resumes a paused stage)
            self.run_ctl(ACTION["unforce"], st.id)
            return
        if st.state != StageState.PENDING:
            self._wrong_state(action, st)
            return
        self._confirm_then_send(action, st, plan=force_plan(st, self.model.stages))

    def action_unforce(self) -> None:
        action = ACTION["unforce"]
        st = self._control_target(action)
        if st is None:
            return
        if not st.forced:
            self._wrong_state(action, st)
            return
        self.run_ctl(action, st.id)

    def _alert_to_ack(self, silence: bool) -> AlertRecord | None:
        """The selected stage's newest alert not yet acknowledged (silenced), else the run's newest."""
        st = self._selected()
        todo = [
            r for r in self.model.alerts.ordered() if (r.acked_at is None if not silence else not r.silenced)
        ]
        mine = [r for r in todo if st is not None and r.stage == st.id]
        pick = mine or todo
        return pick[0] if pick else None

    def _send_ack(self, name: str, silence: bool) -> None:
        if self.refuse_read_only(name):
            return
        alert = self._alert_to_ack(silence)
        if alert is None:
            self.notify("no alert left to acknowledge (a: the run's alerts)", severity="information")
            return
        self.run_ctl(ACTION[name], str(alert.id))

    def act_on_alert(self, name: str, alert: AlertRecord) -> None:
        """``ack_alert`` / ``silence_alert`` for ``alert`` (the alert list's highlighted one): the same control
        path as ``K`` on the board (``ctl ack|silence ID``, audited), refused by a read-only console."""
        if self.read_only:
            self.notify(refusal(name, f"alert #{alert.id}"), title="read-only", severity="warning")
            return
        self.run_ctl(ACTION[name], str(alert.id))

    def action_ack_alert(self) -> None:
        self._send_ack("ack_alert", silence=False)

    def action_silence_alert(self) -> None:
        self._send_ack("silence_alert", silence=True)

    def action_log(self) -> None:
        st = self._selected()
        if st is not None:
            self.open_log(st.id)

    def open_log(self, stage_id: str, title: str | None = None) -> None:
        """The log viewer on ``stages/<id>/stage.log``, read through the transport."""
        screen = LogScreen(LogIndex(self.transport, f"stages/{stage_id}/stage.log"), title or stage_id)
        screen.selected_stage_id = stage_id  # type: ignore[attr-defined]
        self.push_screen(screen)

    def server_stage(self) -> StageView | None:
        services = [s for s in self.model.stages.values() if s.service and s.id != self.model.telemetry_stage]
        return next((s for s in services if s.family == "serve"), services[0] if services else None)

    def action_server_log(self) -> None:
        st = self.server_stage()
        if st is None:
            self.notify(
                "this plan has no inference server stage (a service stage such as serve)", severity="warning"
            )
            return
        self.open_log(st.id, title=f"{st.id} — inference server log")

    def action_datasets(self) -> None:
        if isinstance(self.screen, DatasetsScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(DatasetsScreen(self.model))

    def action_metrics(self) -> None:
        if isinstance(self.screen, MetricsScreen):
            self.screen.dismiss(None)
            return
        st = self._selected()
        if st is not None:
            self.push_screen(MetricsScreen(self.model, st.id, self.compare_runs))

    def action_alert_stage(self) -> None:
        """The alert list; the chosen alert's stage is selected on the board."""

        def chosen(sid: str | None) -> None:
            if sid is not None:
                self.go_to_stage(sid)

        self.push_screen(AlertsScreen(self.model.alerts.ordered()), chosen)

    def go_to_stage(self, sid: str) -> None:
        """Back to the board with ``sid`` selected (the filter cleared if it hid it)."""
        if isinstance(self.screen, DatasetsScreen | MetricsScreen | LogScreen):
            self.screen.dismiss(None)
        board = self.query_one(StageBoard)
        if not board.select_key(sid):
            self.action_clear_filter()  # the filter hid it
            board.sync(self.model)
            if not board.select_key(sid):
                self.notify(f"{sid} is not on the board", severity="warning")

    def action_fold_family(self) -> None:
        """The palette's fold (the board's ``z``): on the board's screen, whichever screen is on top."""
        self.screen_stack[0].query_one(StageBoard).action_fold()

    def action_fold_all_families(self) -> None:
        self.screen_stack[0].query_one(StageBoard).action_fold_all()

    def action_audit(self) -> None:
        if isinstance(self.screen, AuditScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(AuditScreen(self.audit_trail))

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
        sections = help_sections(self.screen)
        board = self.query_one(StageBoard) if self.screen is self.screen_stack[0] else None
        if board is not None and self.focused is not board:  # a click into the log took the board's keys
            rows = binding_rows(self, [b for b in StageBoard.BINDINGS if isinstance(b, Binding)])
            sections.insert(0, ("The board (not focused now: Esc or Tab gives it its keys back)", rows))
        self.push_screen(HelpScreen(sections, notes="Closing the console never stops a stage."))

    def action_focus_board(self) -> None:
        self.query_one(StageBoard).focus()

    def action_quit_console(self) -> None:
        self.exit(
            0,
            message="Aerie console closed; the run keeps going.\nRe-attach: aerie attach "
            f"{self.model.run_dir}{' --read-only' if self.read_only else ''}",
        )

    def action_set_theme(self, name: str) -> None:
        self.theme = name

    def action_toggle_bell(self) -> None:
        self.settings.bell = not self.settings.bell
        self.notify(f"alert bell {'on' if self.settings.bell else 'off'}")

    # ------------------------------------------------------------------------------ palette
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Every action of the screen the palette was opened on, then themes and the rest."""
        cmds = screen_commands(screen)
        cmds += [(a.palette, a.palette_help, getattr(self, f"action_{a.name}")) for a in palette_entries()]
        for name in self.themes:
            cmds.append(
                (
                    f"Theme: {name}",
                    f"switch to the {name} theme",
                    functools.partial(self.action_set_theme, name),
                )
            )
        for title, help_text, cb in cmds:
            yield SystemCommand(title, help_text, cb)
        stand_ins = {a.replaces: a for a in ACTIONS if a.replaces}
        for cmd in super().get_system_commands(screen):
            if (a := stand_ins.get(cmd.title)) is not None:
                yield SystemCommand(a.palette, a.palette_help, getattr(self, f"action_{a.name}"))
            else:
                yield cmd
