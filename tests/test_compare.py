"""Comparing runs in the metrics view: another run directory's metrics drawn beside this run's, a curve per
run named in the legend (``c`` there, or ``aerie attach RUN --compare OTHER``); a path that is not a run is
refused with its name."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input

from console.cli import main
from console.screens.dialogs import PromptScreen
from console.screens.metrics import MetricsScreen
from pipeline.run.stage_side.runtime import StageContext
from pipeline.run.supervise.supervisor import Supervisor
from tests.runs import make_run
from tests.screen_text import svg_rows
from tests.test_console import until
from tests.test_curves import app_for, live_meters, open_metrics  # noqa: F401 (a fixture)

RECIPE_B = """
[run]
name = "recipe-b"
dir = "run"
[[stage]]
id = "train"
command = "true"
"""


def recipe_b(tmp: Path) -> Path:
    """A second run, written by the stage API itself: a training whose loss ends at 0.9 and that reports no acc_0."""
    tmp.mkdir()
    run = make_run(tmp, RECIPE_B)
    sd = run.stage("train")
    ctx = StageContext("train", sd.out, sd.events, run.plan_path)
    for step in range(0, 2001, 100):
        ctx.metric("loss", 3.0 - 2.1 * step / 2000, step=step)
    ctx.close()
    sup = Supervisor(run)
    sup.refresh()
    sup.write_state(force=True)
    return run.root


async def answer(app, pilot, path: str) -> None:  # noqa: ANN001
    """``c``, then the run directory typed into the prompt (set whole: a key per character is slow) and Enter."""
    await pilot.press("c")
    await until(pilot, lambda: isinstance(app.screen, PromptScreen), what="the prompt for a run directory")
    app.screen.query_one(Input).value = path
    await pilot.press("enter")


@pytest.mark.slow  # 5.4-6.6 s: 3.2 s of it is open_metrics settling the shared fixture run (as its other users)
async def test_the_metrics_view_overlays_another_run(tmp_path: Path, live_meters: None) -> None:  # noqa: F811
    other = recipe_b(tmp_path / "b")
    app = app_for(tmp_path / "a")
    async with app.run_test(size=(140, 40), notifications=True) as pilot:
        await open_metrics(app, pilot)
        screen = app.screen
        assert isinstance(screen, MetricsScreen)
        await answer(app, pilot, str(tmp_path / "nowhere"))
        await until(pilot, lambda: len(app._notifications) > 0, what="the refusal")
        said = [n.message for n in app._notifications]
        assert any(str(tmp_path / "nowhere") in m and "no such directory" in m for m in said), said
        assert not screen.others
        await answer(app, pilot, str(other))

        def read() -> bool:
            st = screen.others[0].model.stages.get("train") if screen.others else None
            return st is not None and st.history.get("loss") is not None

        await until(pilot, read, what="the other run's loss read")
        await pilot.pause(0.2)
        text = "\n".join(svg_rows(app.export_screenshot()))
        assert "recipe-b: 0.9" in text, "the other run's curve, named, with its latest value"
        assert "kimi-eagle3: 1.33" in text, "this run's curve, named, beside the other's"
        assert "recipe-b has no acc_0 in train" in text, "the other run lacks acc_0: said so"


def test_compare_with_a_path_that_is_not_a_run_is_refused_naming_it(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    (tmp_path / "a").mkdir()
    run = make_run(tmp_path / "a", RECIPE_B)
    (tmp_path / "plain").mkdir()
    rc = main(["attach", str(run.root), "--compare", str(tmp_path / "plain")])
    assert rc == 2
    err = capsys.readouterr().err
    assert (
        f"--compare {tmp_path / 'plain'}: not a run directory (expected plan.toml and stages/ there)" in err
    )
