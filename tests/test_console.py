"""The console through Textual's Pilot, on real runs driven by a real supervisor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from console.app import AerieApp
from console.screens.dialogs import ConfirmScreen, HelpScreen
from console.transport import LocalTransport
from console.widgets.board import StageBoard
from tests.runs import finished_run, kill_run_stages, make_run, start_supervisor, stop

WORKER = (
    "import sys, time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "n = int(sys.argv[1])\nfor i in range(n):\n    ctx.safe_point()\n"
    "    ctx.progress(i + 1, n, unit='steps', force=True)\n    time.sleep(0.05)\n"
)


async def until(pilot, pred, timeout: float = 20.0, what: str = "condition") -> None:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def live_run(tmp_path: Path):  # noqa: ANN201
    (tmp_path / "w.py").write_text(WORKER)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "live"
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "work"
        command = "{sys.executable} {tmp_path / "w.py"} 600"
        kill_grace_s = 2
        [[stage]]
        id = "after-work"
        command = "echo done"
        after = ["work"]
    """,
    )
    sup = start_supervisor(run)
    yield run
    stop(sup)
    kill_run_stages(run)


def states(app: AerieApp) -> dict[str, str]:
    return {sid: st.state for sid, st in app.model.stages.items()}


async def test_board_shows_states_kill_asks_and_retry_reruns(live_run) -> None:  # noqa: ANN001
    app = AerieApp(LocalTransport(str(live_run.root)), poll_s=0.2)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(
            pilot,
            lambda: states(app).get("work") == "running" and app.model.stages["work"].progress.t,
            what="work running with progress",
        )
        board = app.query_one(StageBoard)
        assert board.row_count == 2
        row = board.get_row("work")
        assert str(row[1]) == "running" and "%" in str(row[4])
        assert states(app)["after-work"] == "pending"

        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation dialog")
        await pilot.press("n")
        await pilot.pause(0.5)
        assert states(app)["work"] == "running", "saying no kills nothing"

        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation dialog")
        await pilot.press("y")
        await until(pilot, lambda: states(app)["work"] == "killed", what="killed")
        await until(pilot, lambda: states(app)["after-work"] == "upstream-failed", what="upstream-failed")
        assert str(board.get_row("work")[1]) == "killed"

        await pilot.press("r")
        await until(
            pilot,
            lambda: states(app)["work"] == "running" and app.model.stages["work"].attempt == 2,
            what="attempt 2 running",
        )
        assert str(board.get_row("work")[2]) == "2"
        assert states(app)["after-work"] == "pending"


async def test_pause_key_pauses_and_resumes(live_run) -> None:  # noqa: ANN001
    app = AerieApp(LocalTransport(str(live_run.root)), poll_s=0.2)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: states(app).get("work") == "running", what="running")
        await pilot.press("p")
        await until(pilot, lambda: states(app)["work"] == "paused", what="paused")
        done = app.model.stages["work"].progress.done
        await pilot.pause(0.8)
        assert app.model.stages["work"].progress.done == done
        await pilot.press("p")
        await until(
            pilot, lambda: app.model.stages["work"].progress.done > done, what="progress after resume"
        )


async def test_filter_help_and_quit_message(live_run) -> None:  # noqa: ANN001
    app = AerieApp(LocalTransport(str(live_run.root)), poll_s=0.2)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        await pilot.press("slash")
        await pilot.press(*"after")
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.query_one(StageBoard).row_count == 1
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert app.query_one(StageBoard).row_count == 2
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        await pilot.press("escape")
        await pilot.press("q")
    assert app.return_code == 0
    assert states(app).get("work") == "running", "quitting the console leaves the stage running"


def test_board_snapshot(snap_compare) -> None:  # noqa: ANN001
    run = finished_run(Path("/tmp/aerie-snapshot"))
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})

    async def loaded(pilot) -> None:  # noqa: ANN001
        await until(pilot, lambda: app.model.loaded and app.model.done, what="the finished run")
        # Attaching selected the latest failure (the killed prep.codefeedback) and its detail shows it.
        await until(pilot, lambda: app.query_one("#detail").stage_id == "prep.codefeedback", what="selection")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(150, 34), run_before=loaded)


def test_server_live_line_on_the_board() -> None:
    from console.model import StageView
    from console.widgets.board import note_for

    st = StageView(id="serve", family="serve", state="running", service=True, health="ready")
    assert note_for(st) == ""  # no scheduler line parsed yet: nothing invented
    st.metrics.update(gen_throughput=1635.1, running_req=32, queue_req=0, token_usage=0.08, accept_len=2.17)
    assert note_for(st) == "1635.1 tok/s · running 32 · queued 0 · tokens 8% · accept 2.17"
    st.state = "succeeded"
    assert "tok/s" not in note_for(st)  # a stopped server shows no live numbers


def test_every_field_of_a_state_json_row_reaches_the_console_view() -> None:
    """The supervisor's row and the console's view are one definition (pipeline/run/rundir/stage_row.py): a
    field the supervisor writes — the Slurm job id, the services a stage uses — is one the board can show."""
    import json
    from dataclasses import asdict

    from console.model import StageView
    from pipeline.run.rundir.stage_row import ROW_FIELDS, StageState
    from pipeline.run.rundir.stage_status import StageStatus

    written = StageStatus(
        id="train", family="train", dataset="chat", state=StageState.FAILED, attempt=3, pid=11, pgid=11,
        started_at=1.0, finished_at=2.0, returncode=1, reason="exit 1", health="ready", pausing=True,
        retry_at=3.0, service=True, gpus=[0, 1], after=["prep"], uses=["serve"], run="train", job="42",
    )  # fmt: skip
    row = json.loads(json.dumps(asdict(written)))  # through state.json
    assert row["state"] == "failed"  # stored as its string
    view = StageView(id=row["id"], family=row["family"])
    view.update_from(row)
    assert {f: getattr(view, f) for f in ROW_FIELDS} == {f: getattr(written, f) for f in ROW_FIELDS}
    assert view.state is StageState.FAILED
    view.update_from({"state": "hibernating"})  # a newer supervisor's state: kept, not a crash
    assert view.state == "hibernating"
