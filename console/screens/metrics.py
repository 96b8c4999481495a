"""The metrics view (``m``): every metric of a stage as curves, or one metric across the stage's attempts.

Left, the stage's metrics (a checklist: Space or Enter ticks one); right, one panel per ticked metric
(each with its own scale), stacked, over steps (training) or time since the attempt's first metric.
``a`` switches to comparing the highlighted metric across the attempts the console keeps (the last
three): one panel, a curve per attempt — "did the resumed run pick up where the failed one was?".
``[`` / ``]`` go to the previous / next stage that has metrics. The view follows the run live.

Other runs (``aerie attach RUN --compare OTHER[,…]``, or ``c`` here, which asks for a run directory):
each panel then has a curve per run — this run's and the same metric of the same stage (or the first
of its family) in each other run, in the legend by run name — and the note says which run lacks the
metric. The other runs are read through :mod:`console.compare`, every few seconds while this view is open.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, SelectionList, Static
from textual.widgets.selection_list import Selection

from console.compare import CompareError, OtherRun, name_runs, open_other
from console.model import RunModel, StageView
from console.widgets.curves import Curve, CurvePlot, short, x_axis

DEFAULT_PICKS = ("loss", "acc_0")
MAX_PANELS = 4
OTHERS_POLL_S = 3.0  # how often the runs compared with are read (they are usually finished runs)


class MetricsScreen(Screen[None]):
    BINDINGS = [
        Binding("escape,m,q", "close", "Back", tooltip="back to the board"),
        Binding(
            "space", "toggle_metric", "Show/hide", show=False, tooltip="show / hide the highlighted metric"
        ),
        Binding(
            "enter", "toggle_metric", "Show/hide", show=False, tooltip="show / hide the highlighted metric"
        ),
        Binding(
            "a",
            "attempts",
            "Attempts",
            tooltip="compare the highlighted metric across attempts (again: back)",
        ),
        Binding(
            "c",
            "compare_run",
            "Compare run",
            tooltip="overlay the same metrics from another run directory (asks for it; empty: stop comparing)",
        ),
        Binding(
            "left_square_bracket",
            "previous_stage",
            "Prev stage",
            tooltip="previous / next stage with metrics",
        ),
        Binding(
            "right_square_bracket", "next_stage", "Next stage", tooltip="previous / next stage with metrics"
        ),
        Binding("question_mark", "help", "Help", tooltip="every key of this screen"),
    ]
    DEFAULT_CSS = """
    MetricsScreen #metrics-title { height: 1; padding: 0 1; background: $panel; }
    MetricsScreen #metrics-body { height: 1fr; }
    MetricsScreen SelectionList { width: 30; height: 1fr; border: none; border-right: solid $panel-lighten-2; }
    MetricsScreen CurvePlot { width: 1fr; height: 1fr; }
    MetricsScreen #metrics-note { height: 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, model: RunModel, stage_id: str, others: list[OtherRun] | None = None) -> None:
        super().__init__()
        self.model = model
        self.others = others if others is not None else []  # the app's list: it outlives this screen
        self.selected_stage_id = stage_id
        self.compare = False
        self._names: list[str] = []
        self._picked: dict[str, set[str]] = {}  # per stage: the metrics shown

    def compose(self) -> ComposeResult:
        yield Static("", id="metrics-title")
        with Horizontal(id="metrics-body"):
            yield SelectionList[str](id="metric-list")
            yield CurvePlot(id="metrics-plot")
        yield Static("", id="metrics-note")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(SelectionList).focus()
        self.sync(self.model)
        self.poll_others()
        self.set_interval(OTHERS_POLL_S, self.poll_others)

    @work(exclusive=True, group="compare")
    async def poll_others(self) -> None:
        """Read the runs compared with (nothing when there are none); redraw when one changed."""
        changed = False
        for other in list(self.others):
            changed |= await other.refresh()
        if changed and self.is_current:
            self._draw()

    # ------------------------------------------------------------------------------ model -> view
    @property
    def stage(self) -> StageView | None:
        return self.model.stages.get(self.selected_stage_id)

    def picked(self) -> set[str]:
        st = self.stage
        if st is None:
            return set()
        if self.selected_stage_id not in self._picked:
            names = st.history.names()
            default = {n for n in DEFAULT_PICKS if n in names} or set(names[:1])
            self._picked[self.selected_stage_id] = default
        return self._picked[self.selected_stage_id]

    def sync(self, model: RunModel) -> None:
        found = self.query(SelectionList)
        if not found:  # a model update before compose or during teardown: nothing to show it in
            return
        st, lst = self.stage, found.first()
        names = st.history.names() if st else []
        picked = self.picked()
        if names != self._names:
            highlighted = lst.highlighted
            self._names = names
            lst.clear_options()
            lst.add_options([Selection(n, n, n in picked) for n in names])
            if names:
                lst.highlighted = min(highlighted or 0, len(names) - 1)
        self._draw()

    def _title(self, st: StageView | None) -> None:
        t = Text()
        t.append(" metrics ", style="bold")
        if st is None:
            t.append(f" {self.selected_stage_id}: no such stage")
        else:
            t.append(f" {st.id} ", style="bold")
            t.append(f" {st.display_state} · attempt {st.attempt}")
            kept = sorted(st.history.attempts)
            if len(kept) > 1:
                t.append(f" · attempts kept {', '.join(map(str, kept))}")
        self.query_one("#metrics-title", Static).update(t)

    def _draw(self) -> None:
        if not self.query(CurvePlot):  # not composed yet, or torn down
            return
        st = self.stage
        self._title(st)
        plot = self.query_one(CurvePlot)
        note = self.query_one("#metrics-note", Static)
        if st is None or not st.history.attempts:
            plot.empty_text = "this stage has reported no metrics yet"
            plot.draw([], "", key=(self.selected_stage_id, "empty"))
            note.update("")
            return
        h = st.history
        if self.compare:
            name = self._highlighted() or (sorted(self.picked()) or h.names())[0]
            runs = h.across_attempts(name)
            xlabel, scale = x_axis(h, name, [s for _a, s in runs])
            curves = [Curve(f"attempt {a}: {short(s.last)}", s) for a, s in runs]
            plot.draw([(f"{name} by attempt", curves)], xlabel, scale, key=(st.id, h.version, "cmp", name))
            note.update(f"{name}: attempts {', '.join(str(a) for a, _ in runs)} · a: back to the metrics")
            return
        names = [n for n in h.names() if n in self.picked()]
        shown = names[:MAX_PANELS]
        panels, missing = self._panels(st, shown)
        series = [s for n in shown if (s := h.get(n)) is not None]
        xlabel, scale = x_axis(h, shown[0], series) if shown else ("", 1.0)
        plot.empty_text = "tick a metric on the left (Space)"
        versions = tuple(o_st.history.version for o in self.others if (o_st := o.stage_like(st)))
        plot.draw(panels, xlabel, scale, key=(st.id, h.version, tuple(shown), len(self.others), versions))
        stride = max((s.stride for s in series), default=1)
        extra = (
            [f"{len(names) - MAX_PANELS} more ticked: showing the first {MAX_PANELS}"]
            if len(names) > MAX_PANELS
            else []
        )
        if stride > 1:
            extra.append(
                f"each point is the mean of {stride} samples (memory stays bounded; TensorBoard has them all)"
            )
        extra += missing
        note.update(" · ".join([f"attempt {h.latest()}", *extra]))

    def _panels(self, st: StageView, shown: list[str]) -> tuple[list[tuple[str, list[Curve]]], list[str]]:
        """A panel per metric: this run's curve, and with other runs one curve each, named by run."""
        h = st.history
        panels = []
        missing: list[str] = []
        this = name_runs(self.model.run_name, str(self.model.run_dir), self.others) if self.others else ""
        for n in shown:
            s = h.get(n)
            if s is None:
                continue
            if not self.others:
                panels.append((f"{n}  {short(s.last)}", [Curve(n, s)]))
                continue
            curves = [Curve(f"{this}: {short(s.last)}", s)]
            for other in self.others:
                o, why = other.series(st, n)
                if o is None:
                    missing.append(why)
                else:
                    curves.append(Curve(f"{other.name}: {short(o.last)}", o))
            panels.append((n, curves))
        return panels, missing

    def _highlighted(self) -> str | None:
        found = self.query(SelectionList)
        lst = found.first() if found else None
        if lst is None or lst.highlighted is None or not self._names:
            return None
        return self._names[min(lst.highlighted, len(self._names) - 1)]

    # ------------------------------------------------------------------------------ actions
    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._picked[self.selected_stage_id] = set(event.selection_list.selected)
        self._draw()

    def on_selection_list_selection_highlighted(self, _event: SelectionList.SelectionHighlighted) -> None:
        if self.compare:
            self._draw()

    def action_toggle_metric(self) -> None:
        lst = self.query_one(SelectionList)
        if lst.highlighted is not None:
            lst.toggle(lst.get_option_at_index(lst.highlighted).value)

    def action_attempts(self) -> None:
        self.compare = not self.compare
        self._draw()

    def action_compare_run(self) -> None:
        from console.screens.dialogs import PromptScreen

        def done(path: str | None) -> None:
            if path is None:
                return
            if not path:
                self.others.clear()
                self.notify("comparing with no other run")
            else:
                try:
                    other = open_other(path)
                except CompareError as exc:
                    self.notify(str(exc), title="compare", severity="error", timeout=10)
                    return
                if any(o.root == other.root for o in self.others):
                    self.notify(f"{path}: already compared", severity="warning")
                    return
                self.others.append(other)
                self.poll_others()
            self._draw()

        self.app.push_screen(
            PromptScreen(
                "Run directory to compare with (its metrics are drawn beside this run's; empty: stop comparing)",
                placeholder="/path/to/other/run",
            ),
            done,
        )

    def action_stage(self, delta: int) -> None:
        with_metrics = [sid for sid in self.model.order if self.model.stages[sid].history.attempts]
        if not with_metrics:
            return
        i = with_metrics.index(self.selected_stage_id) if self.selected_stage_id in with_metrics else -1
        self.selected_stage_id = with_metrics[(i + delta) % len(with_metrics)]
        self._names = []
        self.compare = False
        self.sync(self.model)

    def action_previous_stage(self) -> None:
        self.action_stage(-1)

    def action_next_stage(self) -> None:
        self.action_stage(1)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_help(self) -> None:
        from console.screens.dialogs import HelpScreen, help_sections

        self.app.push_screen(HelpScreen(help_sections(self), title="Metrics — keys"))
