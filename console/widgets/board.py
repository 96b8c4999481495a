"""The stage board: the run's DAG as a table, one row per stage, families grouped as blocks.

Columns: stage, state, attempt, elapsed, progress bar, rate, ETA, note (why it waits, health,
accept length...). A family with several members (the 10 preps) gets a header row with the
aggregate progress and state counts, then its members indented below it. State colours come from
the app's theme (``App.state_style``), never from this widget.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from console import fmt
from console.model import RunModel, StageView

COLUMNS = ("Stage", "State", "Try", "Elapsed", "Progress", "Done", "Rate", "ETA", "Note")
GROUP_PREFIX = "group:"


def note_for(st: StageView) -> str:
    if st.state == "succeeded" and "accept_len" in st.metrics:
        return f"accept len {st.metrics['accept_len']:.2f}"
    if st.state in ("pending", "failed", "killed", "upstream-failed") and st.reason:
        extra = ""
        if st.retry_at:
            extra = f" · auto-retry in {fmt.duration(max(0, st.retry_at - time.time()))}"
        return st.reason + extra
    if st.rejects:
        return f"{st.rejects} rejects"
    for key in ("loss", "tok_s", "accept_len"):
        if key in st.metrics:
            return f"{key} {st.metrics[key]:.4g}"
    if st.gpus and st.state in ("running", "paused"):
        return "GPUs " + ",".join(map(str, st.gpus))
    return ""


class StageBoard(DataTable):
    """The board. Call :meth:`sync` with the model after each poll."""

    DEFAULT_CSS = """
    StageBoard { height: 1fr; }
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kw)  # type: ignore[arg-type]
        self.filter_text = ""
        self._keys: list[str] = []
        self._last_members: set[str] = set()

    def on_mount(self) -> None:
        for name in COLUMNS:
            self.add_column(name, key=name)

    # ------------------------------------------------------------------------------------------
    @property
    def selected_key(self) -> str | None:
        if not self._keys or self.cursor_row < 0 or self.cursor_row >= len(self._keys):
            return None
        return self._keys[self.cursor_row]

    def selected_stage(self, model: RunModel) -> StageView | None:
        key = self.selected_key
        if key is None:
            return None
        if key.startswith(GROUP_PREFIX):
            return None
        return model.stages.get(key)

    def _visible(self, model: RunModel) -> list[tuple[str, StageView | None, list[StageView]]]:
        rows: list[tuple[str, StageView | None, list[StageView]]] = []
        self._last_members = set()
        f = self.filter_text.lower()
        for fam, members in model.families():
            shown = [m for m in members if not f or f in m.id.lower() or f in m.display_state]
            if not shown:
                continue
            if len(members) > 1:
                rows.append((GROUP_PREFIX + fam, None, shown))
                rows.extend((m.id, m, []) for m in shown)
                self._last_members.add(shown[-1].id)
            else:
                rows.append((shown[0].id, shown[0], []))
        return rows

    def sync(self, model: RunModel) -> None:
        rows = self._visible(model)
        keys = [k for k, _, _ in rows]
        now = time.time()
        if keys != self._keys:
            selected = self.selected_key
            self.clear()
            for key, st, members in rows:
                self.add_row(*self._cells(key, st, members, now), key=key)
            self._keys = keys
            if selected in keys:
                self.move_cursor(row=keys.index(selected), animate=False)
            return
        for key, st, members in rows:
            for col, value in zip(COLUMNS, self._cells(key, st, members, now), strict=True):
                self.update_cell(key, col, value)

    def _style(self, state: str) -> str:
        style_of = getattr(self.app, "state_style", None)
        return style_of(state) if style_of else ""

    def _cells(self, key: str, st: StageView | None, members: list[StageView], now: float) -> tuple:
        if st is None:  # a family header
            fam = key[len(GROUP_PREFIX):]
            done = sum(m.progress.done for m in members)
            total = sum(m.progress.total or 0 for m in members)
            frac = done / total if total else None
            counts: dict[str, int] = {}
            for m in members:
                counts[m.display_state] = counts.get(m.display_state, 0) + 1
            summary = Text()
            for i, (state, n) in enumerate(sorted(counts.items(), key=lambda kv: -kv[1])):
                if i:
                    summary.append(" · ")
                summary.append(f"{n} {state}", style=self._style(state))
            rate = sum((m.progress.rate() or 0) for m in members if m.state == "running") or None
            unit = next((m.progress.unit for m in members if m.progress.unit), "")
            eta = max((m.progress.eta_s() or 0 for m in members if m.state == "running"), default=None) or None
            spans = [(m.started_at, m.started_at + (m.elapsed_s(now) or 0)) for m in members if m.started_at]
            elapsed = max(e for _, e in spans) - min(b for b, _ in spans) if spans else None
            return (Text(f"▾ {fam} ({len(members)})", style="bold"), summary, "", fmt.duration(elapsed),
                    _bar(frac), f"{fmt.count(done)}/{fmt.count(total)}" if total else "", fmt.rate(rate, unit) if rate else "",
                    fmt.duration(eta) if eta else "", "")
        branch = "└" if st.id in self._last_members else "├"
        label = Text(f" {branch} {st.id}") if st.family != st.id else Text(st.id)
        state = st.display_state
        frac = st.progress.fraction
        done = (f"{fmt.count(st.progress.done)}/{fmt.count(st.progress.total)}" if st.progress.total
                else (fmt.count(st.progress.done) if st.progress.t else ""))
        running = st.state == "running"
        return (
            label,
            Text(state, style=self._style(state)),
            str(st.attempt),
            fmt.duration(st.elapsed_s(now)),
            _bar(frac if st.state != "succeeded" or frac is not None else 1.0),
            done,
            fmt.rate(st.progress.rate(), st.progress.unit) if running and st.progress.t else "",
            fmt.duration(st.progress.eta_s()) if running and st.progress.eta_s() is not None else "",
            note_for(st),
        )


def _bar(frac: float | None) -> str:
    if frac is None:
        return ""
    return f"{fmt.bar(frac)} {frac * 100:3.0f}%"
