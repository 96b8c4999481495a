"""Curves: the bounded metric history behind them, the plot in the training stage's detail pane and the
metrics view (``m``), and the console's layout at 80x24, 120x40, 160x48 and 220x55 — no value cut, a
log pane wide enough to read (or, at 80x24, behind ``l``), toasts clear of every plot, each proven by a
snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from console.app import AerieApp
from console.model import RunModel, StageView
from console.screens.metrics import MetricsScreen
from console.series import MAX_POINTS, Series, StageHistory
from console.transport import LocalTransport
from console.widgets.meters import MetersPanel
from pipeline.run.rundir.events import make
from tests.runs import console_run, train_metrics
from tests.screen_text import svg_rows
from tests.test_console import until

SIZES = [(80, 24), (120, 40), (160, 48), (220, 55)]
TELEMETRY_NOW = 1796219540.0  # just after the recording's last sample: the meters are live, not stale


@pytest.fixture
def live_meters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MetersPanel, "clock", staticmethod(lambda: TELEMETRY_NOW))


# ------------------------------------------------------------------------------ history
def test_a_multi_day_series_stays_bounded_and_keeps_its_shape() -> None:
    s = Series()
    n = 1_000_000  # a metric every step of a long training
    for step in range(n):
        s.add(step, 10.0 - 9.0 * step / n)
    assert len(s) <= MAX_POINTS
    assert s.xs[0] < 2_000, "the curve still spans the whole run, from its first steps…"
    assert s.xs[-1] > n - 2 * s.stride, "…to its last steps"
    assert s.last == pytest.approx(10.0 - 9.0 * (n - 1) / n), "the latest value is exact"
    gaps = {round(b - a) for a, b in zip(s.xs[:-1], s.xs[1:-1], strict=False)}
    assert gaps == {s.stride}, "evenly spaced: every point is the mean of `stride` samples"
    assert s.ys[len(s) // 2] == pytest.approx(10.0 - 9.0 * s.xs[len(s) // 2] / n, rel=1e-3), (
        "the shape is kept"
    )


def test_a_resumed_training_continues_from_its_checkpoint_step() -> None:
    s = Series()
    for step in range(0, 900, 100):
        s.add(step, 1.0)
    s.add(600, 0.5)  # the resumed attempt went back to its checkpoint
    assert s.xs == [0, 100, 200, 300, 400, 500, 600] and s.ys[-1] == 0.5 and s.last == 0.5


def test_history_keeps_the_last_attempts_and_model_feeds_it_from_events() -> None:
    h = StageHistory()
    for attempt in range(1, 6):
        h.add(attempt, "loss", 1.0 / attempt, 10, 0.0)
    assert sorted(h.attempts) == [3, 4, 5]

    model = RunModel(LocalTransport("/nonexistent"))
    st = model.stages["train"] = StageView(id="train", family="train", attempt=2)
    for attempt, steps in ((1, range(0, 41, 20)), (2, range(20, 61, 20))):
        model._apply_event(st, make("started", t=100.0 * attempt, attempt=attempt))
        for step in steps:
            model._apply_event(
                st,
                make(
                    "metric",
                    t=100.0 * attempt + step,
                    name="loss",
                    value=train_metrics(step)["loss"],
                    step=step,
                ),
            )
    model._apply_event(st, make("metric", t=300.0, name="tokens_per_s", value=41000.0))
    model._apply_event(st, make("metric", t=330.0, name="tokens_per_s", value=42000.0))
    model._apply_event(st, make("metric", t=331.0, name="accept_len", value=2.9, label="eagle3"))
    assert [a for a, _s in st.history.across_attempts("loss")] == [1, 2]
    assert st.history.get("loss", 1).xs == [0, 20, 40] and st.history.get("loss").xs == [20, 40, 60]
    assert st.history.get("tokens_per_s").xs == [0.0, 30.0], (
        "no step: seconds since the attempt's first metric"
    )
    assert st.history.uses_steps("loss") and not st.history.uses_steps("tokens_per_s")
    assert st.history.get("accept_len/eagle3").ys == [2.9]
    assert st.metrics["loss"] == pytest.approx(train_metrics(60)["loss"]), (
        "the latest value still drives the board"
    )


# ------------------------------------------------------------------------------ layout
def app_for(root: Path) -> AerieApp:
    run = console_run(root)
    return AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})


async def select_train(app: AerieApp, pilot) -> None:  # noqa: ANN001
    await until(
        pilot,
        lambda: (
            app.model.loaded
            and app.model.done
            and app.model.telemetry.gpus
            and app.model.telemetry.disk is not None
            and app.model.telemetry.host is not None
        ),
        what="the finished run and its telemetry (GPUs, disk, host)",
    )
    meters = app.query_one(MetersPanel)
    await until(  # the panel redraws on its own tick: on a loaded machine that can come after the pause below
        pilot,
        lambda: len(app.model.telemetry.gpus) == 8 and meters._seen == app.model.telemetry.version,
        what="all 8 GPUs of the last sample drawn in the meters",
    )
    await pilot.press("end", "up")  # train, the stage with curves
    await until(pilot, lambda: app.query_one("#detail").stage_id == "train", what="train selected")
    await until(
        pilot, lambda: app.model.stages["train"].log_total >= 16, what="its log tail in the detail pane"
    )
    await pilot.pause(0.5)


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_every_size_shows_whole_values_and_a_readable_log(
    tmp_path: Path, size: tuple[int, int], live_meters: None
) -> None:
    app = app_for(tmp_path / "r")
    async with app.run_test(size=size) as pilot:
        await select_train(app, pilot)
        rows = svg_rows(app.export_screenshot())
    width = size[0]
    text = "\n".join(rows)
    assert max(len(r) for r in rows) <= width
    assert rows[0].rstrip().endswith("1 failed  12 succeeded"), "the state counts always fit in the header"
    # Board: every done/total value whole (9 full preps, the failed one), and the failure's reason, whole or
    # abbreviated at its end.
    if width >= 100:  # narrower, the Done column is the last to go (docs/operating.md, "Layout")
        assert text.count("120.0K/120.0K") >= min(9, text.count("├ prep.") + text.count("└ prep.") - 1)
    failed = next(
        (r for r in rows[2:] if "prep.sharegpt" in r), None
    )  # below the header and the projection line
    assert failed is not None, "the failed stage is on screen at every size (finished families fold)"
    failed = failed.rstrip(" ▁▂▃▄▅▆▇█")  # the board's scrollbar, where its rows outnumber the lines
    assert "exit 1: KeyError" in failed
    if width >= 100:
        assert "48.2K/120.0K" in failed
        assert failed.endswith("sharegpt_V3_filtered.json)") or failed.endswith("…")
    # Meters: the disk's facts come whole or not at all; every GPU shows its util and memory.
    disk = next(r for r in rows if r.lstrip().startswith("disk"))
    assert "64.0 GiB free of 252.0 GiB" in disk
    assert not disk.rstrip().endswith(" of"), disk
    if size[1] < 30:  # 80x24: the GPUs summed up in the meters' title, so the board keeps its rows
        assert "8 GPUs · util 100% (min 99%) · mem 812/1123G · max 69°C" in text
    else:
        for g in range(8):
            assert any(f"GPU{g}" in r and ("/140" in r) for r in rows), f"GPU{g} values"
    # The detail pane: the training's log beside the facts is wide enough to read a whole step line; at 80x24
    # there is no room for it (a 33-column log shows nothing): the facts take the width and say `l` has it.
    step_rows = [r for r in rows if "[rank0] step  2000/2000" in r]
    if size == (80, 24):
        assert not step_rows and "train  succeeded · attempt 2 · l: its log" in text
        assert "loss=1.33  acc_0=0.724  acc_1=0.5812  acc_2=0.4504  lr=0.0001" in text, "facts whole"
        assert sum("├ prep." in r or "└ prep." in r or "train " in r for r in rows) >= 3, "a usable board"
        return
    assert step_rows, "the last training log line is visible"
    log_w = width - step_rows[0].index("[rank0]")
    assert log_w >= 70, (log_w, step_rows[0])
    # The compact plot of loss and acc_0, with the latest values in its legend (a short terminal has no room
    # for it under the facts: the events are listed there instead).
    if size[1] >= 36:
        assert "⢕⢕ loss 1.33" in text and "⢕⢕ acc_0 0.724" in text
    else:
        assert "⢕⢕" not in text and "acc_0 = 0.724" in text


async def test_a_short_terminal_made_narrower_still_shows_every_gpu(
    tmp_path: Path, live_meters: None
) -> None:
    """A short terminal packs the GPUs into cells, as many per line as fit; narrowing it (a tmux split) needs
    more lines — the grid must grow with it, not keep the line count of the old width and hide the last GPUs
    until the next telemetry sample (a finished run has none)."""
    app = app_for(tmp_path / "r")
    async with app.run_test(size=(160, 30)) as pilot:
        await select_train(app, pilot)
        wide = "\n".join(svg_rows(app.export_screenshot()))
        await pilot.resize_terminal(100, 30)
        await pilot.pause(0.5)
        narrow = svg_rows(app.export_screenshot())
    assert all(f"GPU{g}" in wide for g in range(8))
    gpu_lines = [r for r in narrow if "GPU" in r and "/140G" in r]
    assert len(gpu_lines) == 3, "3 cells of 30 columns per line at 100 columns: 8 GPUs need 3 lines"
    assert all(any(f"GPU{g} " in r for r in gpu_lines) for g in range(8)), narrow


async def test_the_board_shrinks_to_its_rows_and_toasts_stay_off_the_plots(
    tmp_path: Path, live_meters: None
) -> None:
    """One app resized through the four sizes: the board is as tall as its rows (no empty lines above the
    detail pane), and a notification's toast never meets a plot — the detail pane's or the metrics view's."""
    from textual.widgets._toast import Toast

    from console.widgets.board import StageBoard
    from console.widgets.curves import CurvePlot

    app = app_for(tmp_path / "r")
    async with app.run_test(size=SIZES[-1], notifications=True) as pilot:
        await select_train(app, pilot)
        board = app.query_one(StageBoard)
        for metrics in (False, True):
            if metrics:
                await pilot.press("m")
                await until(pilot, lambda: isinstance(app.screen, MetricsScreen), what="the metrics view")
            for size in SIZES:
                await pilot.resize_terminal(*size)
                app.notify(f"a notification long enough to wrap over two lines at {size}", timeout=60)
                await until(pilot, lambda: app.screen.query(Toast), what="the toast")
                await pilot.pause(0.2)
                toasts = [t.region for t in app.screen.query(Toast)]
                plots = [p.region for p in app.screen.query(CurvePlot) if p.display and p.region.area]
                assert toasts and all(t.area for t in toasts)
                if not metrics:
                    assert board.region.height <= board.row_count + 1, "no empty rows under the board"
                    if size[1] >= 36:
                        assert plots, f"the detail pane's curve at {size}"
                        assert board.region.height == board.row_count + 1, "room enough: every row shown"
                else:
                    assert plots, "the metrics view's plot"
                for t in toasts:
                    for p in plots:
                        assert not t.overlaps(p), (size, "metrics" if metrics else "board", t, p)
                app.clear_notifications()
                await pilot.pause(0.1)


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_layout_snapshot(snap_compare, size: tuple[int, int], live_meters: None) -> None:  # noqa: ANN001
    app = app_for(Path(f"/tmp/aerie-layout-{size[0]}x{size[1]}"))
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: settled(app, pilot))


async def settled(app: AerieApp, pilot) -> None:  # noqa: ANN001
    """``select_train``, then until two screenshots 0.3 s apart are the same: on a loaded machine (the suite's
    other workers) the last layout pass can come after ``select_train``'s pause, and a snapshot must not
    catch the screen half-drawn."""
    await select_train(app, pilot)
    last = None
    for _ in range(40):
        shot = app.export_screenshot()
        if shot == last:
            return
        last = shot
        await pilot.pause(0.3)


# ------------------------------------------------------------------------------ metrics view
async def open_metrics(app: AerieApp, pilot, *keys: str) -> None:  # noqa: ANN001
    await select_train(app, pilot)
    await pilot.press("m")
    await until(pilot, lambda: isinstance(app.screen, MetricsScreen), what="the metrics view")
    if keys:
        await pilot.press(*keys)
    await pilot.pause(0.4)


async def test_metrics_view_picks_metrics_and_compares_attempts(tmp_path: Path, live_meters: None) -> None:
    app = app_for(tmp_path / "r")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_metrics(app, pilot)
        screen = app.screen
        assert isinstance(screen, MetricsScreen)
        assert screen.picked() == {"loss", "acc_0"}, "training opens on loss and acc_0"
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "loss  1.33" in text and "acc_0  0.724" in text and "step" in text
        await pilot.press("down", "down", "space")  # tick acc_1
        await until(pilot, lambda: "acc_1" in screen.picked(), what="acc_1 ticked")
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "acc_1  0.5812" in text
        await pilot.press("up", "up", "a")  # loss, across attempts
        await pilot.pause(0.3)
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "loss by attempt" in text and "attempt 1: 2.461" in text and "attempt 2: 1.33" in text
        await pilot.press("]")
        await until(pilot, lambda: screen.selected_stage_id == "bench", what="the next stage with metrics")
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "accept_len/eagle3  2.91" in text or "output_tok_s/eagle3" in text
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, MetricsScreen), what="back to the board")


def test_metrics_view_snapshot(snap_compare, live_meters: None) -> None:  # noqa: ANN001
    app = app_for(Path("/tmp/aerie-metrics-view"))
    assert snap_compare(app, terminal_size=(120, 40), run_before=lambda pilot: open_metrics(app, pilot))


def test_metrics_attempts_snapshot(snap_compare, live_meters: None) -> None:  # noqa: ANN001
    app = app_for(Path("/tmp/aerie-metrics-attempts"))
    assert snap_compare(app, terminal_size=(120, 40), run_before=lambda pilot: open_metrics(app, pilot, "a"))


async def test_attaching_late_still_draws_the_curve_from_step_zero(tmp_path: Path) -> None:
    from pipeline.run.rundir.events import EventWriter

    sd = tmp_path / "stages" / "train"
    sd.mkdir(parents=True)
    with EventWriter(sd / "events.jsonl") as w:  # ~2 MB: attach reads only its last 256 KiB
        w.write(make("started", t=1000.0, attempt=1, pid=1))
        for step in range(0, 4000):
            for name, value in train_metrics(step).items():
                w.write(make("metric", t=1000.0 + step, name=name, value=value, step=step))

    async def attach(backfill: bool) -> StageView:
        model = RunModel(LocalTransport(str(tmp_path)), backfill=backfill)
        model.stages["train"] = StageView(id="train", family="train")
        model.order = ["train"]
        for _ in range(10):
            await model.poll()
        return model.stages["train"]

    late = await attach(backfill=False)
    assert late.history.get("loss").xs[0] > 3000, "the tail alone starts near the end"
    st = await attach(backfill=True)
    loss = st.history.get("loss")
    assert loss.xs[0] < 10 and loss.xs[-1] > 3990, "the head was read back: the whole run"
    assert len(loss) <= 512 and loss.last == pytest.approx(train_metrics(3999)["loss"])
    assert st.history.names()[:2] == ["loss", "acc_0"]


async def test_a_new_metric_reaches_the_detail_plot_at_the_next_poll(tmp_path: Path) -> None:
    """What the operator sees is not throttled by the console's CPU savings (unchanged lines are not
    repainted, the projection is recomputed every few seconds): a loss the training writes is in the detail
    pane's plot — its legend's latest value — as soon as the next poll has read it. The polls are driven by
    the test (no timer), so the count is exact whatever the machine's load."""
    import json
    import time

    from pipeline.run.stage_side.runtime import StageContext

    root = tmp_path / "run"
    root.mkdir()
    row = {"id": "train", "family": "train", "state": "running", "attempt": 1, "started_at": time.time() - 60}
    (root / "state.json").write_text(json.dumps({"run": "r", "executor": "local", "stages": [row]}))
    sd = root / "stages" / "train"
    ctx = StageContext("train", sd / "out", sd / "events.jsonl", None)
    for step in range(20):
        for name, value in train_metrics(step).items():
            ctx.metric(name, value, step=step)
    app = AerieApp(LocalTransport(str(root)), poll_s=3600, alerts=False, user_config={}, read_only=True)

    async def shown_after_a_poll() -> str:
        app.poll_model()
        await until(  # this poll, or the one a new selection started instead (the exclusive group)
            pilot,
            lambda: not any(w.group == "poll" and not w.is_finished for w in app.workers),
            what="a poll",
        )
        await pilot.pause()
        return "\n".join(svg_rows(app.export_screenshot()))

    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(5):  # the first poll finds the stage, the next reads its events
            if "⢕⢕ loss 7.762" in await shown_after_a_poll():
                break
        else:
            raise AssertionError("the plot never showed the training's loss")
        ctx.metric("loss", 0.123, step=20)
        ctx.metric("acc_0", 0.8, step=20)
        text = await shown_after_a_poll()
        assert "⢕⢕ loss 0.123" in text and "⢕⢕ acc_0 0.8" in text, text


async def test_after_a_nan_loss_the_metrics_view_says_nan_and_marks_its_step(tmp_path: Path) -> None:
    """A training whose loss went NaN at step 20 (the ``loss-nonfinite`` alert's case): the metrics view's
    legend says ``loss  nan`` — not the last finite value — and the plot marks the NaN at its step; the
    finite steps before it are still drawn, and a later finite value is the legend again."""
    import json
    import time

    from console.widgets.curves import CurvePlot
    from pipeline.run.stage_side.runtime import StageContext

    root = tmp_path / "run"
    root.mkdir()
    row = {"id": "train", "family": "train", "state": "running", "attempt": 1, "started_at": time.time() - 60}
    (root / "state.json").write_text(json.dumps({"run": "r", "executor": "local", "stages": [row]}))
    sd = root / "stages" / "train"
    ctx = StageContext("train", sd / "out", sd / "events.jsonl", None)
    for step in range(20):
        ctx.metric("loss", 2.3 + 0.01 * (20 - step), step=step)
    ctx.metric("loss", float("nan"), step=20)
    app = AerieApp(LocalTransport(str(root)), poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "train" in app.model.stages, what="the stage")
        await until(pilot, lambda: app.model.stages["train"].history.get("loss") is not None, what="its loss")
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, MetricsScreen), what="the metrics view")
        await pilot.pause(0.4)
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "loss  nan" in text and "loss  2.3" not in text, text
        plot = app.screen.query_one(CurvePlot)
        drawn = plot.render().plain  # the plot as the terminal shows it
        assert "nan" in drawn, drawn  # the mark at step 20, labelled
        loss = app.model.stages["train"].history.get("loss")
        assert loss is not None and loss.nonfinite[0][0] == 20 and len(loss) == 20  # the finite steps drawn
        ctx.metric("loss", float("inf"), step=21)
        await until(pilot, lambda: "loss  inf" in "\n".join(svg_rows(app.export_screenshot())), what="inf")
        ctx.metric("loss", 2.0, step=22)
        await until(
            pilot, lambda: "loss  2" in "\n".join(svg_rows(app.export_screenshot())), what="finite again"
        )
