"""Curves of a stage's metrics, drawn by ``textual-plotext`` (Plotext inside a Textual widget).

:class:`CurvePlot` draws panels of :class:`Curve` s: one panel per metric (each with its own scale),
or one panel with a metric's curves of several attempts. :func:`mini_curves` picks what the detail
pane shows for a stage (loss and acc_0 for training). The plot follows the app's theme (textual-plotext
derives its background and foreground from it); line colours are Plotext's defaults.

A NaN or infinite value (a diverged loss) is no point of the line: it is marked at its step, a vertical line
labelled ``nan`` (``inf``, ``-inf``), and the legend shows the latest value as it is, ``loss nan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual_plotext import PlotextPlot

from console.series import Series, StageHistory

MINI_METRICS = ("loss", "acc_0")


@dataclass
class Curve:
    label: str
    series: Series
    right: bool = False  # on the right y axis (a second scale in the same panel)


def x_axis(history: StageHistory, name: str, series: list[Series]) -> tuple[str, float]:
    """The x axis label and the divisor for a metric: steps as they are; seconds, minutes or hours."""
    if history.uses_steps(name):
        return "step", 1.0
    top = max((s.xs[-1] for s in series if s.xs), default=0.0)
    if top >= 3 * 3600:
        return "hours", 3600.0
    if top >= 3 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def short(v: float | None) -> str:
    if v is None:
        return "—"
    a = abs(v)
    if a >= 1e5 or (0 < a < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


def mini_curves(history: StageHistory) -> list[Curve]:
    """The detail pane's plot: loss (left axis) and acc_0 (right axis) of the latest attempt."""
    out = []
    for i, name in enumerate(MINI_METRICS):
        s = history.get(name)
        if s is not None and s.drawable:
            out.append(Curve(f"{name} {short(s.last)}", s, right=i > 0))
    return out if out and out[0].label.startswith("loss") else []


class CurvePlot(PlotextPlot):
    """A Plotext plot of curves, redrawn by :meth:`draw` (no-op when nothing changed)."""

    DEFAULT_CSS = """
    CurvePlot { width: 1fr; height: 1fr; }
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._key: tuple = ()
        self.empty_text = "no metrics yet"

    def draw(
        self,
        panels: list[tuple[str, list[Curve]]],
        xlabel: str,
        xscale: float = 1.0,
        key: tuple = (),
        compact: bool = False,
    ) -> None:
        """Draw ``panels`` (title, curves) stacked top to bottom; ``key`` identifies the content."""
        if key and key == self._key:
            return
        self._key = key
        p = self.plt
        p.clear_figure()
        panels = [(t, c) for t, c in panels if any(cv.series.drawable for cv in c)]
        if not panels:
            p.title(self.empty_text)
            self.refresh()
            return
        if len(panels) > 1:
            p.subplots(len(panels), 1)
        for i, (title, curves) in enumerate(panels, start=1):
            fig = p.subplot(i, 1) if len(panels) > 1 else p  # a Plotext figure: each panel its own scale
            for c in curves:
                xs = [x / xscale for x in c.series.xs]
                fig.plot(
                    xs,
                    c.series.ys,
                    label=c.label if len(curves) > 1 else None,
                    yside="right" if c.right else "left",
                    marker="braille",
                )
                mark_nonfinite(fig, c, xscale)
            if title:
                fig.title(title)
            if not compact and i == len(panels):
                fig.xlabel(xlabel)
        self.refresh()


def mark_nonfinite(fig: Any, curve: Curve, xscale: float) -> None:
    """Each non-finite value of ``curve`` at its step: a vertical line, and the value's word at its top."""
    ys = curve.series.ys
    top = max(ys) if ys else 1.0
    side = "right" if curve.right else "left"
    for x, v in curve.series.nonfinite:
        fig.vline(x / xscale, "red")
        fig.text(short(v), x / xscale, top, color="red", yside=side)
