"""The small things an operator reads (issue 47 item 9): how long ago, in days; "reports" for one stage; the
CLI's help naming what ``--compare`` and ``aerie status`` really take and print; the board's reason for a stage
that finished having skipped its work on purpose; the help sheet saying that it goes on below."""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path

from textual.app import App, ComposeResult

from console.app import AerieApp
from console.cli import build_parser
from console.header import status_text
from console.model import RunModel, StageView
from console.screens.dialogs import HelpScreen
from console.sup_watch import SupervisorWatch
from console.transport import LocalTransport
from console.widgets.board import StageBoard, note_for
from pipeline.run.projection.compute import RunProjection
from pipeline.run.projection.text import span, status_lines
from pipeline.run.rundir.events import make
from pipeline.run.rundir.protocol import decode
from pipeline.run.supervise.liveness import liveness
from tests.runs import make_run, mixed_run
from tests.screen_text import svg_rows
from tests.test_console import until


def test_a_long_silence_reads_in_days_and_hours(tmp_path: Path) -> None:
    assert [span(s) for s in (9, 125, 3 * 3600 + 300, 415833)] == ["9s", "2m 05s", "3h 05m", "4d 19h"]
    run = make_run(tmp_path, '[run]\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')
    now = time.time()
    rep = liveness(run, {"stages": [], "supervisor": {"pid": 1, "t": now - 415833}}, now=now)
    assert rep["verdict"] == "dead" and "4d 19h ago" in rep["text"] and "415833s" not in rep["text"], rep
    assert time.strftime("%Y-%m-%d", time.localtime(now - 415833)) in rep["text"], "another day: its date"


def test_every_silence_line_reads_in_days_and_hours(tmp_path: Path) -> None:
    """The supervisor's silence, said on each line that says it (the console's watch, the status line without
    a watch, the host's "slow" verdict), for a snapshot 415833 s old: ``4d 19h``, never ``415833s``."""
    old = 415833
    watch = SupervisorWatch(read_only=False, clock=lambda: 1000.0 + old)
    watch.moved_at = 1000.0  # the snapshot last moved 415833 s ago; the host not asked yet
    said = watch.line(done=False)
    assert said == ("supervisor silent for 4d 19h — checking…", "warning"), said
    run = make_run(tmp_path, '[run]\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')
    model = RunModel(LocalTransport(str(run.root)))
    model.order, model.supervisor_t = ["a"], 1000.0
    line = status_text(model, 1.0, lambda _state: "", now=1000.0 + old).plain
    assert line == "supervisor silent for 4d 19h", line
    lock = os.open(run.root, os.O_RDONLY | os.O_DIRECTORY)
    try:  # a supervisor that holds the run's lock but wrote nothing for days, no write failed: "slow"
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        rep = liveness(run, {"stages": [], "supervisor": {"pid": 1, "t": now - old}}, now=now)
    finally:
        os.close(lock)
    assert rep["verdict"] == "silent" and "slow: no snapshot for 4d 19h" in rep["text"], rep
    assert "415833" not in rep["text"], rep


def _projection(unknown: list[str]) -> RunProjection:
    now = time.time()
    return RunProjection(
        now=now,
        progress=None,
        stages_done=0,
        stages_total=len(unknown),
        started_at=now - 60,
        finish_at=now,
        remaining_s=0.0,
        finished=False,
        blocked=[],
        paused=[],
        gpu_hours_used=0.0,
        gpu_hours_projected=0.0,
        disk_at_finish=None,
        disk_total=None,
        disk_mount=None,
        assumed=[],
        unknown=list(unknown),
        unknown_open=list(unknown),
    )


def test_one_stage_reports_several_report() -> None:
    one = "\n".join(status_lines(_projection(["trainish"])))
    two = "\n".join(status_lines(_projection(["a", "b"])))
    assert "trainish reports no progress" in one and "trainish report no" not in one
    assert "a, b report no progress" in two


def test_the_cli_help_says_what_compare_and_status_take_and_print() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices  # type: ignore[union-attr]
    attach = sub["attach"].format_help()
    assert "ssh://" in " ".join(attach.split()) and "local run directories" not in attach
    status = " ".join(sub["status"].format_help().split())
    for word in ("projection", "anomalies", "error", "supervisor", "audit"):
        assert word in status, word


def test_a_stage_done_that_skipped_its_work_on_purpose_says_why_on_the_board() -> None:
    st = StageView(id="regen.swe-agent", family="regen", state="succeeded")
    text = "16 of 16 prompts are 547-591 tokens, not shorter than target.max_length 512: not sent"
    st.events.append(decode(make("message", level="warning", code="prompts-too-long", text=text)))
    st.events.append(decode(make("progress", done=0, total=0, unit="rows")))
    assert note_for(st) == f"⚠ {text}"


class BoardApp(App[None]):
    """The board alone, synced with a model built here (a folded family, nothing else around it)."""

    def compose(self) -> ComposeResult:
        yield StageBoard()


def _family_with_a_warned_and_a_forced_member(root: Path) -> RunModel:
    model = RunModel(LocalTransport(str(root)))
    for i, state in enumerate(["succeeded"] * 4 + ["pending"]):
        st = StageView(id=f"regen.d{i}", family="regen", state=state)
        model.stages[st.id], model.order = st, [*model.order, st.id]
    warned = model.stages["regen.d1"]  # the demo's swe-agent regen: every prompt skipped on purpose
    warned.events.append(decode(make("message", level="warning", code="prompts-too-long", text=SKIPPED)))
    model.stages["regen.d4"].forced = True  # aerie force armed on it, not started yet
    routine = model.stages["regen.d2"]  # did its work and warned on the way (a rejected row): folds away
    routine.events.append(decode(make("message", level="warning", code="reject", text="row 23: no answer")))
    routine.progress.done, routine.progress.total = 24, 24
    return model


SKIPPED = "16 of 16 prompts are 547-591 tokens, not shorter than target.max_length 512: not sent"


async def test_a_folded_family_keeps_a_warned_and_a_forced_member_listed(tmp_path: Path) -> None:
    """A member done having skipped all its work, with a warning (its ⚠ reason), and one with a force armed
    (⚑) stay listed under their family when it folds — by the operator (``z``) or by itself to fit the
    board — while the members that did their work hide, a routine warning or not (issue 47 items 5, 9)."""
    model = _family_with_a_warned_and_a_forced_member(tmp_path)
    app = BoardApp()
    async with app.run_test(size=(160, 20)) as pilot:
        board = app.query_one(StageBoard)
        for fold in ("operator", "room"):
            board.folds = {"regen": True} if fold == "operator" else {}
            board.room = 0 if fold == "operator" else 3  # 6 rows unfolded do not fit 3: it folds itself
            board.sync(model)
            await pilot.pause()
            assert board.is_folded("regen"), fold
            keys = [r.key for r in board._rows]
            assert keys == ["group:regen", "regen.d1", "regen.d4"], (fold, keys)
            rows = "\n".join(svg_rows(app.export_screenshot()))
            assert f"⚠ {SKIPPED}"[:60] in rows and "⚑ force armed" in rows, rows
            assert "regen.d0" not in rows and "regen.d2" not in rows, "the members that did their work fold"


async def _help_sheet(root: Path) -> tuple[str, str, str]:
    run = mixed_run(root)
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    app.ensure_supervisor = lambda: None  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        await pilot.pause(0.3)
        top = "\n".join(svg_rows(app.export_screenshot()))
        await pilot.press("end")
        await pilot.pause(0.3)
        end = "\n".join(svg_rows(app.export_screenshot()))
        return top, end, str(app.screen.query_one("#help-scroll").border_subtitle)


def test_the_help_sheet_says_it_goes_on_below(tmp_path: Path) -> None:
    top, end, _sub = asyncio.run(_help_sheet(tmp_path))
    assert "more lines below: ↓ / PgDn" in top, top
    assert "more lines below" not in end and "more lines above: ↑ / PgUp" in end, end
