"""Meters: the GPU panel (one row per GPU), the disk meter and the host meter, fed by a TelemetryModel.

Mount ``MetersPanel(model)`` and keep feeding the model (``model.feed(lines)`` or
``model.ingest(data, size, ino)``): the panel redraws within ``poll_s`` whenever ``model.version``
changed (or call :meth:`MetersPanel.sync` at once). A GPU row reads::

    GPU0 H200    util ██████████ 100%  mem ▆▁▁▁▁▁▁▁▁▁ 9.1/140.4 GiB  62°C  635/700 W  gpuwork  ▁▁▃▇████

Rows are mounted and removed as GPUs appear, from none (with the reason: no driver, waiting) to 8
or more; on a short terminal (:meth:`MetersPanel.set_compact`) the GPUs are cells of a grid instead,
several per line. A meter too narrow for all its facts drops the least important ones whole
(:meth:`MeterLine.fit`) rather than cutting a value in the middle. Every colour comes from the theme through component classes (``$primary``, ``$warning``,
``$error``...), so themes restyle the meters; nothing here names a colour.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from console.telemetry_model import GpuView, TelemetryModel, duration, size

if TYPE_CHECKING:
    from textual.geometry import Size as Cells
    from textual.timer import Timer

SPARK = "▁▂▃▄▅▆▇█"
BAR_W = 10
HOT_C = 85.0


def bar(fraction: float | None, width: int = BAR_W) -> tuple[str, str]:
    """(filled, empty) parts of a bar; eighths for the partial cell."""
    if fraction is None:
        return "", "·" * width
    f = min(1.0, max(0.0, fraction))
    eighths = int(round(f * width * 8))
    full, part = divmod(eighths, 8)
    filled = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part and full < width else "")
    return filled, "░" * (width - len(filled))


def sparkline(values: list[float], width: int, top: float = 100.0) -> str:
    """The last ``width`` values on an absolute 0..``top`` scale (left-padded while history fills)."""
    if width <= 0:
        return ""
    vals = values[-width:]
    top_i = len(SPARK) - 1
    chars = [SPARK[min(top_i, max(0, int(round(v / top * top_i))))] if top else SPARK[0] for v in vals]
    return " " * (width - len(chars)) + "".join(chars)


def short_gpu_name(name: str) -> str:
    for prefix in ("NVIDIA ", "Tesla "):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def gpu_summary(gpus: list[GpuView]) -> str:
    """Every GPU in a few words (the meters of a tiny terminal): mean and lowest utilisation, memory, hottest."""
    utils = [g.util for g in gpus if g.util is not None]
    used = sum(g.mem_used or 0 for g in gpus)
    total = sum(g.mem_total or 0 for g in gpus)
    temps = [g.temp_c for g in gpus if g.temp_c is not None]
    out = []
    if utils:
        out.append(f"util {sum(utils) / len(utils):.0f}% (min {min(utils):.0f}%)")
    if total:
        out.append(f"mem {used / (1 << 30):.0f}/{total / (1 << 30):.0f}G")
    if temps:
        out.append(f"max {max(temps):.0f}°C")
    if any(g.has_foreign or g.ecc_uncorrected or g.xid_total for g in gpus):
        out.append("! see the GPUs (taller terminal)")
    return " · ".join(out) or "no GPU reading yet"


class MeterLine(Widget):
    """A one-line meter rendered as styled text; the styles are theme-driven component classes."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "meters--label",
        "meters--bar",
        "meters--bar-alt",
        "meters--bar-empty",
        "meters--muted",
        "meters--ok",
        "meters--warning",
        "meters--error",
        "meters--owner",
        "meters--foreign",
        "meters--spark",
    }
    DEFAULT_CSS = """
    MeterLine { height: 1; width: 1fr; }
    MeterLine > .meters--label { color: $foreground; text-style: bold; }
    MeterLine > .meters--bar { color: $primary; }
    MeterLine > .meters--bar-alt { color: $secondary; }
    MeterLine > .meters--bar-empty { color: $foreground-muted; }
    MeterLine > .meters--muted { color: $foreground-muted; }
    MeterLine > .meters--ok { color: $success; }
    MeterLine > .meters--warning { color: $warning; text-style: bold; }
    MeterLine > .meters--error { color: $error; text-style: bold; }
    MeterLine > .meters--owner { color: $accent; }
    MeterLine > .meters--foreign { color: $error; text-style: bold; }
    MeterLine > .meters--spark { color: $primary; }
    """

    def __init__(self, model: TelemetryModel, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.model = model

    def st(self, name: str) -> Style:
        return self.get_component_rich_style(f"meters--{name}", partial=True)

    def fit(self, t: Text, pieces: list[tuple[str, Style | str]], reserve: int = 0) -> None:
        """Append the pieces that fit in the widget's width, in order, each whole or not at all.

        A narrow meter drops its least important facts instead of cutting a value in the middle.
        """
        room = self.size.width - reserve
        for text, style in pieces:
            if t.cell_len + len(text) <= room:
                t.append(text, style)

    def add_bar(self, t: Text, fraction: float | None, style: str = "bar", width: int = BAR_W) -> None:
        filled, empty = bar(fraction, width)
        t.append(filled, self.st(style))
        t.append(empty, self.st("bar-empty"))


class GpuRow(MeterLine):
    """One GPU: util and memory bars, temperature, power, owning stage(s), util sparkline."""

    def __init__(self, model: TelemetryModel, index: int, **kw: object) -> None:
        super().__init__(model, **kw)
        self.index = index

    @property
    def gpu(self) -> GpuView | None:
        return self.model.gpus.get(self.index)

    def render(self) -> Text:
        g = self.gpu
        t = Text(no_wrap=True, overflow="ellipsis")
        if g is None:
            return t
        w = self.size.width
        # Narrow terminals get shorter bars and owner column first; the sparkline takes what is left.
        bw, ow, compact = (10, 22, False) if w >= 118 else ((6, 16, False) if w >= 92 else (4, 12, True))
        t.append(f"GPU{g.index:<2} {short_gpu_name(g.name)[:8]:<8} ", self.st("label"))
        if not compact:
            t.append("util ", self.st("muted"))
        self.add_bar(t, g.util / 100.0 if g.util is not None else None, width=bw)
        t.append(f" {g.util:>3.0f}%  " if g.util is not None else "   —  ")
        if not compact:
            t.append("mem ", self.st("muted"))
        self.add_bar(t, g.mem_fraction, "bar-alt", width=bw)
        used = (
            size(g.mem_used).replace(" GiB", "")
            if g.mem_total and g.mem_total >= 1 << 30
            else size(g.mem_used)
        )
        t.append(f" {used}/{size(g.mem_total):<10} ")
        hot = g.temp_c is not None and g.temp_c >= HOT_C
        t.append(
            f"{g.temp_c:>3.0f}°C " if g.temp_c is not None else "  —°C ", self.st("warning") if hot else ""
        )
        if g.power_w is not None:
            near_cap = bool(g.power_cap_w) and g.power_w >= 0.97 * float(g.power_cap_w or 0)
            cap = f"/{g.power_cap_w:.0f}" if g.power_cap_w and not compact else ""
            t.append(
                f"{g.power_w:>4.0f}{cap} W ".rjust(7 if compact else 11),
                self.st("warning") if near_cap else "",
            )
        else:
            t.append("   — W " if compact else "     — W   ")
        t.append(" ")
        if g.ecc_uncorrected or g.xid_total:
            t.append(f"ECC {g.ecc_uncorrected or 0} XID {g.xid_total}  ", self.st("error"))
        owners = g.owners
        label = ", ".join(owners) if owners else "idle"
        label = label if len(label) <= ow else label[: ow - 1] + "…"
        style = self.st("foreign") if g.has_foreign else (self.st("owner") if owners else self.st("muted"))
        t.append(f"{label:<{ow}} ", style)
        spark_w = max(0, w - t.cell_len)
        t.append(sparkline(list(g.util_hist), spark_w), self.st("spark"))
        return t


class DiskMeter(MeterLine):
    """The run-dir filesystem: a used bar, free space, growth rate, 'full in', fit of the projection."""

    def render(self) -> Text:
        d = self.model.disk
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("disk     ", self.st("label"))
        if d is None:
            t.append("waiting for telemetry…", self.st("muted"))
            return t
        frac = d.used_fraction
        parts, level = d.status_parts()
        narrow = self.size.width < 70
        self.add_bar(
            t,
            frac,
            "error" if level == "error" else ("warning" if level == "warning" else "bar"),
            width=6 if narrow else BAR_W,
        )
        t.append(
            f" {d.use_percent:>3}% used" if d.use_percent is not None else "   —"
        )  # df's Use%, rounded up
        # the name gives way to the first fact after it (the free space), never the other way round
        first = len(parts[0]) if parts else 0
        lim = max(12, min(32, self.size.width - t.cell_len - 3 - first))
        where = d.where if len(d.where) <= lim else "…" + d.where[-(lim - 1) :]
        t.append(f" {where}  ", self.st("muted"))  # which filesystem: the projection line names the same
        style = self.st(level) if level != "ok" else ""
        self.fit(t, [(("" if i == 0 else " · ") + p, style) for i, p in enumerate(parts)])
        return t


class HostMeter(MeterLine):
    """Host CPU (all cores) and RAM, with a CPU sparkline."""

    def render(self) -> Text:
        h = self.model.host
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("host     ", self.st("label"))
        if h is None:
            t.append("waiting for telemetry…", self.st("muted"))
            return t
        narrow = self.size.width < 90
        bw = 6 if narrow else BAR_W
        t.append("cpu ", self.st("muted"))
        self.add_bar(t, h.cpu_pct / 100.0 if h.cpu_pct is not None else None, width=bw)
        t.append(f" {h.cpu_pct:>3.0f}%" if h.cpu_pct is not None else "   —")
        t.append(f" of {h.ncpu} cores" if h.ncpu else "")
        t.append("  ram ", self.st("muted"))
        mf = h.mem_fraction
        self.add_bar(t, mf, "warning" if mf is not None and mf > 0.92 else "bar-alt", width=bw)
        t.append(f" {size(h.mem_used)}/{size(h.mem_total)}")
        if h.load1 is not None:
            self.fit(t, [(f" · load {h.load1:.1f}", self.st("muted"))])
        t.append("  ")
        t.append(sparkline(list(h.cpu_hist), max(0, self.size.width - t.cell_len)), self.st("spark"))
        return t


class GpuGrid(MeterLine):
    """Every GPU as a cell, several per line: the meters of a short terminal (8 GPUs in 2 lines at 100 columns).

    A cell reads ``GPU3 ███▌  97% 98/140G 62°C``: util bar and percentage, memory used/total, temperature.
    """

    DEFAULT_CSS = """
    GpuGrid { height: auto; }
    """
    CELL_W = 30

    def cells_per_line(self) -> int:
        return max(1, self.size.width // self.CELL_W)

    def lines_for(self, width: int) -> int:
        n = len(self.model.gpus)
        return max(1, -(-n // max(1, width // self.CELL_W)))

    def get_content_height(self, container: Cells, viewport: Cells, width: int) -> int:
        """As many lines as the cells need at the width the layout gives (not a width read earlier: a
        height set from a stale width hid the last GPUs until the next sample)."""
        return self.lines_for(width)

    def render(self) -> Text:
        t = Text(no_wrap=True, overflow="crop")
        per = self.cells_per_line()
        for k, g in enumerate(self.model.gpu_rows()):
            if k and k % per == 0:
                t.append("\n")
            cell = Text()
            cell.append(f"GPU{g.index:<2}", self.st("label"))
            self.add_bar(cell, g.util / 100.0 if g.util is not None else None, width=4)
            cell.append(f"{g.util:>4.0f}%" if g.util is not None else "    —")
            mem = (
                f" {g.mem_used / (1 << 30):.0f}/{g.mem_total / (1 << 30):.0f}G"
                if g.mem_used is not None and g.mem_total
                else " —"
            )
            cell.append(mem)
            hot = g.temp_c is not None and g.temp_c >= HOT_C
            cell.append(
                f" {g.temp_c:.0f}°C" if g.temp_c is not None else "", self.st("warning") if hot else ""
            )
            if g.has_foreign or g.ecc_uncorrected or g.xid_total:
                cell.append(" !", self.st("error"))
            cell.pad_right(self.CELL_W - cell.cell_len)
            t.append_text(cell)
        return t


class GpuPanel(Vertical):
    """A row per GPU (mounted/removed as GPUs come and go), or why there are none."""

    DEFAULT_CSS = """
    GpuPanel { height: auto; }
    GpuPanel > .gpu-note { height: 1; color: $foreground-muted; }
    """

    def __init__(self, model: TelemetryModel, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.model = model
        self.compact = False  # a cell per GPU, several per line (short terminals), instead of a row per GPU

    def compose(self) -> ComposeResult:
        yield Static("", classes="gpu-note")
        yield GpuGrid(self.model)

    def sync(self) -> None:
        note = self.query_one(".gpu-note", Static)
        note.update(self.model.gpu_note)
        note.display = not self.model.gpus
        grid = self.query_one(GpuGrid)
        grid.display = self.compact and bool(self.model.gpus)
        if grid.display:
            grid.refresh(layout=True)  # the GPU count may have changed: so may the lines it needs
        rows = {r.index: r for r in self.query(GpuRow)}
        wanted = [] if self.compact else sorted(self.model.gpus)
        for idx, row in rows.items():
            if idx not in wanted:
                row.remove()
        new = [GpuRow(self.model, i, id=f"gpu-row-{i}") for i in wanted if i not in rows]
        if new:
            self.mount_all(new)
            if rows:  # keep index order when a GPU appears between existing rows
                self.sort_children(key=lambda w: getattr(w, "index", -1))
        for idx, row in rows.items():
            if idx in wanted:
                row.refresh()


class MetersPanel(Vertical):
    """GPU panel, disk meter and host meter over one :class:`TelemetryModel`."""

    DEFAULT_CSS = """
    MetersPanel { height: auto; padding: 0 1; }
    MetersPanel > .meters-title { height: 1; color: $foreground-muted; }
    MetersPanel > .meters-title.-stale { color: $warning; }
    """

    clock: Callable[[], float] = staticmethod(time.time)  # what "now" is for the sample's age (tests fix it)

    def __init__(self, model: TelemetryModel, poll_s: float = 1.0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.model = model
        self.poll_s = poll_s
        self._seen = -1
        self._title_text = ""
        self._ticker: Timer | None = None
        self.tiny = False

    def compose(self) -> ComposeResult:
        yield Static("", classes="meters-title")
        yield GpuPanel(self.model)
        yield DiskMeter(self.model)
        yield HostMeter(self.model)

    def on_mount(self) -> None:
        self.sync()
        self._ticker = self.set_interval(self.poll_s, self._tick)

    # Hidden (a run without a telemetry stage, or clipped away), the panel's clock stops: no wake-up of the
    # UI loop each second for nothing. Shown again, it catches up at once.
    def on_hide(self) -> None:
        if self._ticker is not None:
            self._ticker.pause()

    def on_show(self) -> None:
        if self._ticker is not None:
            self._ticker.resume()
            self._tick()

    def _tick(self) -> None:
        if not self.display:
            if self._ticker is not None:
                self._ticker.pause()  # hidden before it was ever shown (no Hide then): on_show resumes it
            return
        if self.model.version != self._seen:
            self.sync()
        else:
            self._title()  # ages keep moving

    def _title(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        m = self.model
        n = len(m.gpus)
        host = m.meta.get("host")
        parts = [f"telemetry{' · ' + str(host) if host else ''} · {n} GPU{'s' if n != 1 else ''}"]
        if self.tiny and n:
            parts.append(gpu_summary(m.gpu_rows()))
        stale = m.stale(now)
        if stale:
            parts.append(f"last sample {duration(m.age_s(now))} ago")
        title = self.query_one(".meters-title", Static)
        text = " · ".join(parts)
        if text != self._title_text:  # an unchanged title costs no repaint
            self._title_text = text
            title.update(text, layout=False)
        title.set_class(stale, "-stale")

    def set_compact(self, compact: bool, tiny: bool = False) -> None:
        """GPUs as a grid of cells (short terminals) or a row each; ``tiny`` (under 30 rows): no GPU lines and
        no host line, the GPUs summed up in the title, so the board keeps its rows (80x24)."""
        panel = self.query_one(GpuPanel)
        if panel.compact != compact or self.tiny != tiny:
            panel.compact = compact
            self.tiny = tiny
            panel.display = not tiny
            self.query_one(HostMeter).display = not tiny
            self.sync()

    def sync(self) -> None:
        """Redraw from the model now."""
        self._seen = self.model.version
        self._title()
        self.query_one(GpuPanel).sync()
        self.query_one(DiskMeter).refresh()
        self.query_one(HostMeter).refresh()
