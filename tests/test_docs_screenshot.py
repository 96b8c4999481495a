"""The README's picture (``docs/console.svg``) is the console as it is: ``docs/screenshot.py`` shoots it on the
real demo run, and this test shoots it again and compares what a reader sees — the board's columns, the meters,
the footer's keys, the demo's stages — not pixels (times, rates and which regen answers first differ run to run).
When the console's look changes on purpose, regenerate it: ``python docs/screenshot.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli import demo_plan_path
from console.widgets.board import COLUMNS
from pipeline.run.plan import dag as plan_mod
from tests.runs import ROOT, at_normal_priority
from tests.screen_text import svg_rows

COMMITTED = ROOT / "docs" / "console.svg"


def structure(rows: list[str]) -> dict[str, object]:
    """What a reader takes from the picture: the column header, the meters, the footer and the stage labels."""
    head = next(i for i, r in enumerate(rows) if r.startswith("Stage "))
    rule = next(i for i in range(head, len(rows)) if rows[i].startswith("────"))
    labels = {
        r.split()[1] if r.split()[0] in ("├", "└", "▸", "▾") else r.split()[0] for r in rows[head + 1 : rule]
    }
    return {
        "size": (max(len(r) for r in rows), len(rows)),
        "columns": rows[head].split(),
        "meters": [r.split()[0] for r in rows[rule + 1 :] if r.split() and r.split()[0] in ("disk", "host")],
        "footer": rows[-1].split(),
        "labels": labels,
    }


def demo_names() -> set[str]:
    """The demo plan's stage ids (its per-dataset stages expanded) and families."""
    stages = plan_mod.load(demo_plan_path()).stages
    return {s.id for s in stages} | {s.family for s in stages}


def test_the_committed_picture_is_of_the_demo() -> None:
    shown = structure(svg_rows(COMMITTED.read_text()))
    # The board's columns as the console names them now (it drops a column with nothing to show at a width).
    assert shown["columns"][:5] == list(COLUMNS[:5]) and set(shown["columns"]) <= set(COLUMNS), shown[
        "columns"
    ]
    assert shown["labels"] and shown["labels"] <= demo_names(), shown["labels"]
    assert {"prep", "serve", "regen"} <= shown["labels"], "the picture shows the run under way"
    readme = (ROOT / "README.md").read_text()
    assert "docs/console.svg" in readme, "the README shows it"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_picture_is_the_console_as_it_is(tmp_path: Path) -> None:
    out = tmp_path / "console.svg"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "screenshot.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=880,
        preexec_fn=at_normal_priority,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    fresh, committed = structure(svg_rows(out.read_text())), structure(svg_rows(COMMITTED.read_text()))
    assert fresh["columns"][:5] == committed["columns"][:5]  # the rest come and go with what there is to show
    for key in ("size", "meters", "footer"):
        assert fresh[key] == committed[key], f"{key}: regenerate with `python docs/screenshot.py`"
    assert fresh["labels"] <= demo_names() and {"prep", "serve", "regen"} <= fresh["labels"], fresh["labels"]


async def test_the_screenshot_refuses_a_console_that_selected_nothing(tmp_path: Path) -> None:
    """``docs/screenshot.py`` writes no picture of a console whose board selected no stage ("Select a stage"
    in the detail pane, issue 47 item 8): such a first screen is a bug to fix, not the README's picture."""
    import importlib.util

    from console.app import AerieApp
    from console.transport import LocalTransport
    from tests.runs import mixed_run
    from tests.test_console import until

    spec = importlib.util.spec_from_file_location("screenshot", ROOT / "docs" / "screenshot.py")
    assert spec is not None and spec.loader is not None
    shot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shot)
    empty = AerieApp(LocalTransport(str(tmp_path / "none")), poll_s=0.2, alerts=False, user_config={})
    empty.ensure_supervisor = lambda: None  # type: ignore[method-assign]
    async with empty.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.5)  # no run there: nothing loads, nothing is selected
        said = shot.no_selection(empty)
        assert said and "selected no stage" in said, said
    run = mixed_run(tmp_path / "r")
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    app.ensure_supervisor = lambda: None  # type: ignore[method-assign]
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: shot.no_selection(app) is None, what="a stage selected")
