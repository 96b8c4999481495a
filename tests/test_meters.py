"""The meters widgets in a small Textual app, rendering the real H200 recording (replicated to 8 GPUs
for a full node: each copy is GPU 0's recorded readings)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.text import Text
from textual.app import App, ComposeResult
from textual.color import Color

from console.telemetry_model import TelemetryModel
from console.widgets.meters import DiskMeter, GpuRow, HostMeter, MetersPanel

FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"


def lines(upto_seq: int | None = None) -> list[str]:
    out = FIXTURE.read_text().splitlines()
    if upto_seq is None:
        return out
    return [ln for ln in out if json.loads(ln).get("seq", 0) <= upto_seq]


def replicated(n: int) -> list[str]:
    out = []
    for line in lines():
        r = json.loads(line)
        out.extend(json.dumps(dict(r, index=i)) for i in range(n)) if r["kind"] == "gpu" else out.append(line)
    return out


class MetersApp(App[None]):
    def __init__(self, model: TelemetryModel) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield MetersPanel(self.model, id="meters")


def span_style(text: Text, needle: str):  # noqa: ANN201 - rich Style
    start = text.plain.index(needle)
    styles = [s.style for s in text.spans if s.start <= start < s.end]
    assert styles, f"no style on {needle!r}"
    return styles[-1]


async def test_the_h200_recording_renders_one_row_with_the_owning_stage() -> None:
    m = TelemetryModel()
    m.feed(lines())
    app = MetersApp(m)
    async with app.run_test(size=(140, 12)) as pilot:
        await pilot.pause()
        (row,) = app.query(GpuRow)
        text = row.render().plain
        for part in ("GPU0", "H200", "99%", "9.7/140.4 GiB", "62°C", "634/700 W", "gpuwork"):
            assert part in text, (part, text)
        # The sparkline: ten idle samples (foreign holder), then the stage's full load.
        assert text.rstrip().endswith("▁" * 10 + "▁▁▁" + "█" * 8)
        assert len(text) <= 140
        disk = app.query_one(DiskMeter).render().plain
        assert "free of 252.0 GiB" in disk and "/tmp/aerie-telemetry-run" in disk
        host = app.query_one(HostMeter).render().plain
        assert "of 16 cores" in host and "/125.8 GiB" in host


async def test_a_foreign_holder_is_named_and_styled_from_the_theme() -> None:
    m = TelemetryModel()
    m.feed(lines(upto_seq=3))
    app = MetersApp(m)
    async with app.run_test(size=(140, 12)) as pilot:
        await pilot.pause()
        row = app.query_one(GpuRow)
        text = row.render()
        assert "foreign pid 424" in text.plain
        style = span_style(text, "foreign pid 424")
        assert style.bold
        assert style.color.triplet == Color.parse(app.get_css_variables()["error"]).rich_color.triplet
        # Another theme, other colours: nothing is hard-coded.
        before = span_style(text, "▁").color  # the util sparkline
        app.theme = "textual-light" if app.theme != "textual-light" else "nord"
        await pilot.pause()
        after = span_style(row.render(), "▁").color
        assert after != before
        assert after.triplet == Color.parse(app.get_css_variables()["primary"]).rich_color.triplet


async def test_the_panel_scales_from_no_gpus_to_eight_and_back() -> None:
    m = TelemetryModel()
    app = MetersApp(m)
    async with app.run_test(size=(120, 20)) as pilot:
        panel = app.query_one(MetersPanel)
        await pilot.pause()
        assert not app.query(GpuRow)
        m.feed(
            [
                json.dumps(
                    {
                        "kind": "meta",
                        "t": 1,
                        "interval_s": 2,
                        "host": "cpu-box",
                        "nvml": {"ok": False, "error": "no NVIDIA driver on this host"},
                    }
                )
            ]
        )
        panel.sync()
        await pilot.pause()
        note = app.query_one(".gpu-note")
        assert note.display and "no GPU readings: no NVIDIA driver on this host" in str(note.render())
        m.feed(replicated(8))
        panel.sync()
        await pilot.pause()
        rows = list(app.query(GpuRow))
        assert [r.index for r in rows] == list(range(8)) and not note.display
        assert all(r.region.height == 1 for r in rows) and len({r.region.y for r in rows}) == 8
        assert "8 GPUs" in str(app.query_one(".meters-title").render())
        # The agent restarts on a host with two GPUs: rows for the others go away.
        m.feed([json.dumps({"kind": "meta", "t": 2, "interval_s": 2, "nvml": {"ok": True, "count": 2}})])
        panel.sync()
        await pilot.pause()
        assert [r.index for r in app.query(GpuRow)] == [0, 1]


async def test_narrow_terminals_shrink_the_bars_and_sparkline_not_the_numbers() -> None:
    m = TelemetryModel()
    m.feed(lines())
    sparks = {}
    for width in (84, 100, 140, 200):
        app = MetersApp(m)
        async with app.run_test(size=(width, 12)) as pilot:
            await pilot.pause()
            row = app.query_one(GpuRow)
            text = row.render().plain
            assert len(text) <= row.size.width, (width, text)
            for part in ("GPU0", "99%", "9.7/140.4 GiB", "62°C", "634", "gpuwork"):
                assert part in text, (width, part, text)
            sparks[width] = len(text) - len(text.rstrip("▁▂▃▄▅▆▇█"))
    # Narrow: the latest samples only; wide: the whole recording (21 samples), padded on the left.
    assert 0 < sparks[100] < sparks[140] == sparks[200] == 21


async def test_the_disk_meter_warns_when_the_projected_output_does_not_fit() -> None:
    m = TelemetryModel()
    tb = 10**12
    m.feed(
        [
            json.dumps(
                {
                    "kind": "disk",
                    "t": t,
                    "seq": t,
                    "path": "/runs/kimi",
                    "total": 11 * tb,
                    "used": 9 * tb + t * 10**9,
                    "avail": 2 * tb - t * 10**9,
                    "reserve": 10**11,
                    "projected_remaining": 3 * tb,
                }
            )
            for t in range(0, 40, 2)
        ]
    )
    app = MetersApp(m)
    async with app.run_test(size=(180, 12)) as pilot:
        await pilot.pause()
        disk = app.query_one(DiskMeter)
        text = disk.render()
        assert "full in" in text.plain and "still to write" in text.plain and "short" in text.plain
        warn = span_style(text, "⚠")
        assert warn.color.triplet == Color.parse(app.get_css_variables()["warning"]).rich_color.triplet


async def test_the_disk_meter_says_dfs_use_percent() -> None:
    """``df`` of a thin virtual disk: 264 GiB size, 28.7 GiB used, 77.7 GiB available: Use% 27 %. The meter
    says 27 % used (df's used / (used + avail)), not the 71 % that (size − avail) / size gives; and it rounds
    up as ``df`` does (29.2 % reads 30 %)."""
    gib = 1 << 30
    m = TelemetryModel()
    m.feed(
        [
            json.dumps(
                {
                    "kind": "disk",
                    "t": 1.0,
                    "seq": 1,
                    "path": "/runs/x",
                    "total": 264 * gib,
                    "used": int(28.7 * gib),
                    "avail": int(77.7 * gib),
                }
            )
        ]
    )
    app = MetersApp(m)
    async with app.run_test(size=(160, 12)) as pilot:
        await pilot.pause()
        text = app.query_one(DiskMeter).render().plain
        assert " 27% used" in text and "71%" not in text, text
        assert "77.7 GiB free of 264.0 GiB" in text, text
        # df rounds Use% up: 29.2 GiB used, 70.8 GiB available is 29.2 %, which df prints 30 % (not 29)
        record = {"kind": "disk", "t": 2.0, "seq": 2, "path": "/runs/x", "total": 264 * gib}
        m.feed([json.dumps(record | {"used": int(29.2 * gib), "avail": int(70.8 * gib)})])
        app.query_one(DiskMeter).refresh()
        await pilot.pause()
        text = app.query_one(DiskMeter).render().plain
        assert " 30% used" in text and "29%" not in text, text
        # ... and an exact 27 % (27 of 100 GiB) stays 27, as in df (integer arithmetic, no 27.000001)
        m.feed([json.dumps(record | {"t": 3.0, "seq": 3, "used": 27 * gib, "avail": 73 * gib})])
        await pilot.pause()
        assert " 27% used" in app.query_one(DiskMeter).render().plain
