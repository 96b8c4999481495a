"""What the operator sees at 3 a.m. (issue 40): the board at 80x24 keeps the running and failed stages on screen
(families fold, by themselves or with z / Z), the footer keeps ? and q, attaching selects the most relevant stage,
toasts never cover the board, a corrupt state.json says why the console waits, and the disk is named alike by
the meter and the projection. One run (tests/runs.py ``mixed_run``: running, failed, finished and waiting
stages, fixed pids and times, ``time.time`` frozen) drawn at 80x24, 120x40 and 200x60 as snapshots."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from textual.widgets._toast import Toast

from console import sup_watch
from console.app import AerieApp, most_relevant
from console.headless import follow
from console.model import RunModel, StageView
from console.screens.dialogs import HelpScreen
from console.transport import CtlResult, LocalTransport
from console.widgets.board import StageBoard
from console.widgets.detail import StageDetail
from console.widgets.meters import MetersPanel
from pipeline.run.alerts import record as alert_record
from pipeline.run.supervise import budget
from tests.runs import MIXED_NOW, TELEMETRY_FIXTURE, make_run, mixed_run, start_supervisor, stop, wait_done
from tests.screen_text import svg_rows
from tests.test_console import live_run, until  # noqa: F401 (a fixture: a real supervisor, a command)

SIZES = [(80, 24), (120, 40), (200, 60)]
RUNNING = ["prep.sharegpt", "prep.kimi-2000x", "prep.codefeedback"]
FAILED = "prep.ultrachat"


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's "now", and no supervisor (nothing rewrites the run's state.json): the same screen every time."""
    monkeypatch.setattr(time, "time", lambda: MIXED_NOW)
    monkeypatch.setattr(MetersPanel, "clock", staticmethod(lambda: MIXED_NOW))
    monkeypatch.setattr(AerieApp, "ensure_supervisor", lambda self: None)


def app_for(root: Path) -> AerieApp:
    run = mixed_run(root)
    return AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})


async def settled(app: AerieApp, pilot) -> None:  # noqa: ANN001
    """Loaded, the telemetry drawn, the failed stage selected with its log tail, and two screenshots alike."""
    meters = app.query_one(MetersPanel)
    await until(
        pilot,
        lambda: (
            app.model.loaded
            and len(app.model.telemetry.gpus) == 8
            and app.model.telemetry.disk is not None
            and app.model.telemetry.host is not None
            and meters._seen == app.model.telemetry.version
            and app.query_one(StageDetail).stage_id == FAILED
            and app.model.stages[FAILED].log_total > 10
        ),
        what="the run, its telemetry and the failed stage's detail",
    )
    last = None
    for _ in range(40):
        shot = app.export_screenshot()
        if shot == last:
            return
        last = shot
        await pilot.pause(0.3)


def screen(app: AerieApp) -> list[str]:
    return svg_rows(app.export_screenshot())


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_operator_view_snapshot(snap_compare, size: tuple[int, int], frozen: None) -> None:  # noqa: ANN001
    app = app_for(Path(f"/tmp/aerie-opsview-{size[0]}x{size[1]}"))
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: settled(app, pilot))


async def test_at_80x24_running_and_failed_stages_stay_on_screen(tmp_path: Path, frozen: None) -> None:
    app = app_for(tmp_path / "r")
    async with app.run_test(size=(80, 24)) as pilot:
        await settled(app, pilot)
        board = app.query_one(StageBoard)
        rows = screen(app)
        shown = "\n".join(rows[board.region.y : board.region.bottom])
        for sid in [*RUNNING, FAILED, "train", "bench"]:
            assert sid in shown, f"{sid} is on the board at 80x24:\n{shown}"
        assert "prep.swe-agent" not in shown, "the finished preps folded away by themselves"
        assert "▸ prep (10)" in shown and "6 succeeded · 3 running · 1 failed" in shown
        assert rows[-1].lstrip().startswith("? Help  q Quit"), f"the footer keeps ? and q first: {rows[-1]!r}"
        assert app.query_one(StageDetail).stage_id == FAILED, "attach selects the failed stage"
        assert "KeyError: 'conversations'" in "\n".join(rows[board.region.bottom :]), "and shows why"

        await pilot.press("Z")  # every family unfolded: more rows than room
        await until(pilot, lambda: board.row_count == 14, what="all 13 stages and the family row")
        assert board.is_folded("prep") is False
        await pilot.press("end")  # the last stage: scrolled into view
        await until(pilot, lambda: board.selected_key == "bench", what="bench selected")
        await pilot.pause(0.2)
        rows = screen(app)
        assert "bench" in "\n".join(rows[board.region.y : board.region.bottom]), "the selection is on screen"
        await pilot.press("home")
        await until(pilot, lambda: board.selected_key == "group:prep", what="the family row")
        await pilot.press("z")  # the selected family folds again; its failed and running members stay
        await until(pilot, lambda: board.row_count == 8, what="prep folded")
        assert [k for k in board._index if k.startswith("prep.")] == [FAILED, *RUNNING]
        await pilot.press("z")
        await until(pilot, lambda: board.row_count == 14, what="prep unfolded: the operator's choice holds")


async def test_toasts_never_cover_the_board(tmp_path: Path, frozen: None) -> None:
    app = app_for(tmp_path / "r")
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await settled(app, pilot)
        board = app.query_one(StageBoard)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            app.notify(
                "prep.ultrachat failed: KeyError 'conversations' (row 48212 of ultrachat.jsonl)", timeout=60
            )
            await until(pilot, lambda: app.screen.query(Toast), what="the toast")
            await pilot.pause(0.3)
            toasts = [t.region for t in app.screen.query(Toast)]
            assert toasts and all(t.area for t in toasts)
            for t in toasts:
                assert not t.overlaps(board.region), (size, t, board.region)
            app.clear_notifications()
            await pilot.pause(0.1)


def test_the_most_relevant_stage_is_the_failed_then_alerted_then_running_then_last_finished() -> None:
    model = RunModel(LocalTransport("/nonexistent"))

    def put(sid: str, state: str, finished: float | None = None, service: bool = False) -> None:
        model.stages[sid] = StageView(id=sid, family=sid, state=state, finished_at=finished, service=service)
        model.order.append(sid)

    assert most_relevant(model) is None
    put("first", "pending")
    put("second", "pending")
    assert most_relevant(model) == "first", "nothing started yet: the next stage to run, never nothing"
    model.stages.clear()
    model.order.clear()
    put("a", "succeeded", 10.0)
    put("b", "succeeded", 30.0)
    put("c", "succeeded", 20.0)
    put("pending", "pending")
    assert most_relevant(model) == "b", "nothing running or failed: the stage that finished last"
    put("telemetry", "succeeded", 60.0, service=True)
    assert most_relevant(model) == "b", (
        "a service stopped at the run's end says less than the last work stage"
    )
    put("server", "running", service=True)
    assert most_relevant(model) == "server"
    put("work", "running")
    assert most_relevant(model) == "work", "a work stage before a service"
    gap = alert_record.AlertRecord(1, "accept-gap:c:1", "accept-gap", "c", 1, "c: gap", "x", [], 70.0)
    alert_record.apply(model.alerts.book, alert_record.raised_line(gap))
    assert most_relevant(model) == "c", "an open alert before what merely runs"
    put("old-failure", "failed", 40.0)
    put("new-failure", "killed", 50.0)
    assert most_relevant(model) == "new-failure", "the latest failure first"


async def test_the_first_screen_selects_a_stage_and_follows_the_run_until_the_operator_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's first snapshot has every stage waiting: the console selects the next to run (not a family row,
    not "Select a stage"), follows the run to the stage that starts, and a family's row (Home) shows that
    family's stage most worth a look. Once the operator moved, the cursor is theirs."""
    monkeypatch.setattr(
        AerieApp, "ensure_supervisor", lambda self: None
    )  # nothing but this test writes state
    run = make_run(tmp_path, '[run]\nname = "f"\ndir = "run"\n[[stage]]\nid = "x"\ncommand = "true"\n')

    def snapshot(**states: str) -> None:
        rows = [
            {"id": sid, "family": sid.split(".")[0], "state": st, "attempt": 1, "reason": ""}
            | ({"finished_at": 100.0} if st in ("succeeded", "failed") else {})
            for sid, st in states.items()
        ]
        run.state_path.write_text(json.dumps({"run": "f", "stages": rows}))

    snapshot(**{"prep.a": "pending", "prep.b": "pending", "serve": "pending"})
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.1, alerts=False, user_config={})
    async with app.run_test(size=(140, 36)) as pilot:
        board = app.query_one(StageBoard)
        detail = app.query_one(StageDetail)
        await until(pilot, lambda: board.selected_key == "prep.a", what="the next stage to run selected")
        await pilot.pause(0.3)
        assert "Select a stage" not in "\n".join(screen(app))
        snapshot(**{"prep.a": "succeeded", "prep.b": "pending", "serve": "running"})
        await until(pilot, lambda: board.selected_key == "serve", what="the selection following the run")
        await pilot.press("home")  # the family row of prep
        await until(pilot, lambda: detail.stage_id == "prep.a", what="the family's stage in the detail pane")
        await pilot.pause(0.3)
        text = "\n".join(screen(app))
        assert "family prep (2 stages)" in text and "Select a stage" not in text, text
        snapshot(**{"prep.a": "succeeded", "prep.b": "failed", "serve": "running"})
        await until(pilot, lambda: app.model.stages["prep.b"].state == "failed", what="prep.b failed")
        await pilot.pause(0.5)
        assert board.selected_key == "group:prep" or board.selected_key.startswith("prep"), board.selected_key
        assert board.selected_key != "prep.b", "the operator moved: the cursor stays where they put it"
        assert detail.stage_id == "prep.b", "the family row shows its failure, the stage most worth a look"


async def test_the_selection_follows_the_run_past_a_family_that_folded_when_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo at 120x40: the console follows a running prep; all preps end and their family folds to fit, which
    moves the cursor to prep's row. That is the board's move, not the operator's: the console goes on to the
    regen that runs now (it stayed on a finished prep family for the rest of the run)."""
    monkeypatch.setattr(AerieApp, "ensure_supervisor", lambda self: None)
    run = make_run(tmp_path, '[run]\nname = "f"\ndir = "run"\n[[stage]]\nid = "x"\ncommand = "true"\n')
    preps = [f"prep.d{i:02d}" for i in range(12)]
    regens = [f"regen.r{i:02d}" for i in range(8)]

    def snapshot(states: dict[str, str]) -> None:
        rows = [
            {"id": sid, "family": sid.split(".")[0], "state": st, "attempt": 1, "reason": ""}
            | ({"finished_at": 100.0} if st == "succeeded" else {})
            for sid, st in states.items()
        ]
        run.state_path.write_text(json.dumps({"run": "f", "stages": rows}))

    snapshot({"prep.d00": "running"} | dict.fromkeys(preps[1:] + regens + ["train"], "pending"))
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.1, alerts=False, user_config={})
    async with app.run_test(size=(80, 24)) as pilot:
        board = app.query_one(StageBoard)
        await until(pilot, lambda: board.selected_key == "prep.d00", what="the running prep selected")
        snapshot(
            dict.fromkeys(preps, "succeeded")
            | {"regen.r00": "running"}
            | dict.fromkeys(regens[1:], "pending")
        )
        await until(
            pilot, lambda: board.selected_key == "regen.r00", what="the selection following to the regen"
        )
        assert board.is_folded("prep")


async def test_at_80x24_the_first_selection_keeps_the_folds_that_fit_the_board(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stage waits and prep's 12 members do not fit 80x24: the console selects prep's row (its detail
    shows the next prep to run) instead of unfolding the family off the screen."""
    monkeypatch.setattr(AerieApp, "ensure_supervisor", lambda self: None)
    run = make_run(tmp_path, '[run]\nname = "f"\ndir = "run"\n[[stage]]\nid = "x"\ncommand = "true"\n')
    ids = [f"prep.d{i:02d}" for i in range(12)] + ["serve", "train", "bench"]
    rows = [{"id": i, "family": i.split(".")[0], "state": "pending", "attempt": 1, "reason": ""} for i in ids]
    run.state_path.write_text(json.dumps({"run": "f", "stages": rows}))
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.1, alerts=False, user_config={})
    async with app.run_test(size=(80, 24)) as pilot:
        board = app.query_one(StageBoard)
        await until(pilot, lambda: board.selected_key == "group:prep", what="prep's row selected")
        await until(
            pilot, lambda: app.query_one(StageDetail).stage_id == "prep.d00", what="its next stage shown"
        )
        assert board.is_folded("prep") and "prep" not in board.folds, "the console left the folds as they fit"


async def test_focus_is_shown_and_help_lists_the_focused_panes_keys_and_the_boards(
    tmp_path: Path, frozen: None
) -> None:
    app = app_for(tmp_path)
    async with app.run_test(size=(140, 40)) as pilot:
        await settled(app, pilot)
        board = app.query_one(StageBoard)
        bottom = app.query_one("#bottom")
        assert app.focused is board and not bottom.border_title
        await pilot.click("#stage-log")
        assert app.focused is not board
        assert "log pane focused" in str(bottom.border_title) and "Esc" in str(bottom.border_title)
        await pilot.pause(0.2)
        assert "log pane focused" in "\n".join(screen(app)), "the title is on screen"
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        text = app.screen.text  # type: ignore[attr-defined]
        assert "scroll the focused log pane up / down" in text and "PgUp / PgDn" in text
        board_part = text.split("[The board (not focused now")[1].split("\n[")[0]
        for words in ("↑ / ↓  previous / next stage", "Home / End  first / last stage", "z  fold", "Z  fold"):
            assert words in board_part, (words, board_part)
        await pilot.press("escape")
        await pilot.press("escape")  # the log pane's Esc: the board's keys again
        assert app.focused is board and not bottom.border_title
        selected = board.selected_key
        await pilot.press("down")
        assert board.selected_key != selected, "the arrows move the board again"


class HostNotAnswering(LocalTransport):
    """The run's files read as ever, but no ``ctl`` answer comes (a host slow to run the liveness check): what
    the console shows from the snapshot alone. Once the host says the supervisor is dead, a read-only watcher
    shows every stage from its files instead (test_a_read_only_watcher_with_no_supervisor_…)."""

    async def ctl(self, *args: str) -> CtlResult:
        await asyncio.Event().wait()  # never set
        raise AssertionError("unreachable")


async def test_a_read_only_watcher_on_a_corrupt_state_says_why_it_waits(tmp_path: Path) -> None:
    run = make_run(tmp_path, '[run]\nname = "c"\ndir = "run"\n[[stage]]\nid = "x"\ncommand = "true"\n')
    run.state_path.write_text('{"run": "c", "stages": [{"id": "x", "sta')  # cut short: not valid JSON
    # (CI: under load the liveness answer and the rows from files came within the test's 0.3 s)
    app = AerieApp(HostNotAnswering(str(run.root)), poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.model.state_problem is not None, what="the state read")
        await pilot.pause(0.3)
        text = "\n".join(screen(app))
        assert "state.json is truncated or not valid JSON at byte" in text, text
        assert "waiting for the supervisor's next snapshot" in text
        assert "first snapshot" not in text
        # The supervisor writes a good snapshot: the console loads it, the note goes.
        run.state_path.write_text(
            json.dumps({"run": "c", "stages": [{"id": "x", "family": "x", "state": "pending"}]})
        )
        await until(pilot, lambda: app.model.loaded, what="the good snapshot")
        assert app.model.state_problem is None
        await pilot.pause(0.3)
        assert "not valid JSON" not in "\n".join(screen(app))


async def test_a_read_only_watcher_with_no_supervisor_shows_every_stage_from_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No state.json and no supervisor (it finished, the snapshot was lost in a copy): a read-only watcher starts
    none, yet shows every stage as its own files say (the rows ``aerie status`` prints), says the supervisor is
    down and how to start it, and its re-attach hint on ``q`` keeps ``--read-only``."""
    run = make_run(
        tmp_path,
        '[run]\nname = "ro"\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n'
        '[[stage]]\nid = "b"\ncommand = "exit 3"\nafter = ["a"]\n[[stage]]\nid = "c"\ncommand = "true"\n'
        'after = ["b"]\n',
    )
    sup = start_supervisor(run)
    try:
        wait_done(run)
    finally:
        stop(sup)
    run.state_path.unlink()
    status = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {ln.split()[0]: ln.split()[1] for ln in status.stdout.splitlines()[:3]}
    assert rows == {"a": "succeeded", "b": "failed", "c": "waiting"}, status.stdout
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(140, 30)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="the stages from their files")
        await pilot.pause(0.5)
        text = "\n".join(screen(app))
        assert {sid: str(st.state) for sid, st in app.model.stages.items()} == rows
        assert "first snapshot" not in text
        assert "supervisor dead" in text and "not restarting it" in text, text
        said = app.sup_watch.line(app.model.done)  # the status line, whole (the screen may cut it)
        assert said and f"to start it: aerie attach {run.root} without --read-only" in said[0], said
        assert "to start it: aerie attach" in text, text
        assert "from its files" in text, "the detail pane says where the row comes from"
        assert app.query_one(StageBoard).selected_key == "b", "the failure is the stage most worth a look"
        await pilot.press("q")
    assert app.return_code == 0
    # Headless, the same: the host is asked once the snapshot is overdue (1 s here), then the rows are printed.
    monkeypatch.setattr(sup_watch, "STALE_S", 1.0)
    out = io.StringIO()
    await follow(LocalTransport(str(run.root)), out=out, poll_s=0.2, timeout_s=6, read_only=True)
    said = out.getvalue()
    assert "not restarting it" in said and re.search(r" b +failed", said), said
    assert not run.state_path.exists(), "a watcher started no supervisor"


def test_the_re_attach_hint_keeps_read_only(tmp_path: Path) -> None:
    root = tmp_path / "run"
    app = AerieApp(LocalTransport(str(root)), poll_s=0.2, alerts=False, user_config={}, read_only=True)
    exits: list[str] = []
    app.exit = lambda *_a, message="", **_k: exits.append(str(message))  # type: ignore[method-assign]
    app.action_quit_console()
    assert exits and exits[0].endswith(f"aerie attach {root} --read-only"), exits


def test_the_start_it_hint_names_the_run_as_attach_takes_it(tmp_path: Path) -> None:
    """A read-only watcher's "to start it" names the run itself — its path here, ``ssh://user@host:port/path``
    on another host, quoted for a shell — not a placeholder (issue 47 item 6)."""
    from console.ssh.connection import HostConnection, parse_ssh_url
    from console.ssh.transport import RemoteLayout, SshTransport

    dead = {"verdict": "dead", "text": "supervisor dead (last seen 10:01:02, 20s ago)"}
    root = tmp_path / "my run"
    watch = sup_watch.SupervisorWatch(read_only=True)
    watch.run, watch.report = sup_watch.run_address(LocalTransport(str(root))), dead
    said = watch.line(done=False)
    assert said and f"to start it: aerie attach '{root}' without --read-only" in said[0], said
    target, remote = parse_ssh_url("ssh://ops@gpu1:2222/runs/x")
    transport = SshTransport(HostConnection(target), RemoteLayout(root=remote, python="python3"))
    assert sup_watch.run_address(transport) == "ssh://ops@gpu1:2222/runs/x"  # nothing connects


async def test_the_disk_meter_and_the_projection_name_the_same_filesystem(
    tmp_path: Path, frozen: None
) -> None:
    app = app_for(tmp_path / "r")
    async with app.run_test(size=(200, 60)) as pilot:
        await settled(app, pilot)
        rows = screen(app)
        disk = app.model.telemetry.disk
        assert disk is not None and disk.mount == "/data (/dev/nvme1n1)"
        meter = next(r for r in rows if r.lstrip().startswith("disk "))
        # The meter's percentage is df's Use%: used / (used + avail) rounded up, not (total - avail) / total
        # (75 % here).
        assert disk.used is not None and disk.avail is not None and disk.total is not None
        use = -(-100 * disk.used // (disk.used + disk.avail))
        assert "/data (/dev/nvme1n1)" in meter and f"{use}% used" in meter and "75%" not in meter, meter
        # The projection, on the same screen, in the same terms: df's used + still to write, of used + avail;
        # its free space is the meter's less what is still to write (the two never contradict).
        to_write = disk.projected_remaining or 0
        end = -(-100 * (disk.used + to_write) // (disk.used + disk.avail))
        free = (disk.avail - to_write) / (1 << 30)
        assert f"disk at end on /data: {end}% used, {free:.1f} GiB free" in rows[1], rows[1]
        assert end >= use, "the disk fills, never empties, by the end"


def test_the_agent_and_aerie_status_name_the_run_dirs_filesystem(tmp_path: Path) -> None:
    from pipeline.run.hosts.gpus import (
        FakeNvmlReplay,  # no GPU here: a recorded NVML session (named as a fake)
    )
    from pipeline.run.supervise.run_projection import run_projection
    from pipeline.stages.telemetry import Agent

    run = make_run(tmp_path, '[run]\nname = "d"\ndir = "run"\n[[stage]]\nid = "x"\ncommand = "true"\n')
    mount = budget.mount_of(run.root)
    point = mount.split(" (")[0]
    assert Path(point).is_mount() and str(run.root.resolve()).startswith(point)
    agent = Agent(
        FakeNvmlReplay(TELEMETRY_FIXTURE), tmp_path / "tel", run=run, message=lambda text, **kw: None
    )
    rec = agent._disk(time.time())
    assert rec["mount"] == mount
    proj = run_projection(run, {"stages": []}, time.time())
    total, used, avail = budget.disk_free(run.root)
    assert proj["disk_mount"] == mount and proj["disk_total"] == total
    assert proj["disk_at_finish"] >= used - (1 << 20), "counted as the meter counts (df's used)"
    assert proj["disk_free_at_finish"] <= avail + (1 << 20), "and free as df's avail, less what is to write"


NAN_STAGE = (
    "import time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "for i in range(8):\n    ctx.metric('loss', 3.0 - 0.1 * i, step=i)\n"
    "ctx.metric('loss', float('nan'), step=8)\ntime.sleep(60)\n"
)


def test_aerie_status_lists_the_alerts_going_on_with_evidence(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A real supervisor runs a training whose loss turns NaN; ``aerie status`` (text and --json) names it."""
    import sys

    from console.cli import main
    from tests.runs import kill_run_stages, start_supervisor, states, stop, wait_for

    (tmp_path / "nan.py").write_text(NAN_STAGE)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "odd"
        dir = "run"
        [[stage]]
        id = "trainer"
        command = "{sys.executable} {tmp_path / "nan.py"}"
        kill_grace_s = 1
        """,
    )
    sup = start_supervisor(run)
    try:
        ev = run.stage("trainer").events
        wait_for(
            lambda: ev.exists() and ev.read_bytes().count(b'"metric"') >= 9, what="the NaN loss in the events"
        )
        wait_for(lambda: states(run).get("trainer") == "running", what="trainer running")
        alerts = run.root / "alerts.jsonl"  # raised by the supervisor, no front end needed
        wait_for(
            lambda: alerts.exists() and b"loss-nonfinite" in alerts.read_bytes(), what="the alert record"
        )
        assert main(["status", str(run.root)]) == 0
        out = capsys.readouterr().out
        assert "alerts: 1 open, 0 cleared" in out, out
        assert "loss-nonfinite" in out and "loss = nan at step 8" in out
        assert main(["status", str(run.root), "--json"]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        (found,) = [d["anomalies"] for d in lines if "anomalies" in d]
        assert [(a["kind"], a["stage"]) for a in found] == [("loss-nonfinite", "trainer")]
        assert any("loss = nan at step 8" in e for e in found[0]["evidence"])
    finally:
        stop(sup)
        kill_run_stages(run)


async def test_a_live_run_of_shell_commands_never_says_finish_now(live_run) -> None:  # noqa: ANN001, F811
    """The issue's case: operator commands, one reporting progress (StageContext from its AERIE_* environment):
    the header's projection measures that one and says the finish is unknown while the other has no size."""
    app = AerieApp(LocalTransport(str(live_run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(140, 36)) as pilot:
        await until(
            pilot,
            lambda: app.model.stages.get("work") is not None and app.model.stages["work"].progress.t > 0,
            what="work reporting progress",
        )
        app.projection.every_s = 0  # recompute on every poll (the 5 s cache is not what is tested)

        def line() -> str:
            return str(app.query_one("#projection").content)

        await until(
            pilot, lambda: "after-work reports no size" in line(), what="work measured, after-work not"
        )
        text = line()
        assert text.startswith("0/2 stages · finish unknown: after-work reports no size"), text
        assert "finish now" not in text and "100%" not in text


def test_families_fold_quiet_ones_first_and_keep_the_operators_choice() -> None:
    from console.widgets.board_cells import auto_folds

    def fam(name: str, *states: str) -> tuple[str, list[StageView]]:
        return name, [StageView(id=f"{name}.{i}", family=name, state=s) for i, s in enumerate(states)]

    families = [
        fam("prep", *["succeeded"] * 8, "running"),
        fam("regen", *["pending"] * 4),
        fam("train", "pending"),
    ]
    # Rows unfolded: 10 + 5 + 1 = 16.
    assert auto_folds(families, {}, 0) == set(), "no room given: nothing folds"
    assert auto_folds(families, {}, 16) == set()
    assert auto_folds(families, {}, 12) == {"regen"}, "the family with nothing to look at folds first"
    assert auto_folds(families, {}, 6) == {"regen", "prep"}, "then all (prep keeps its running member)"
    assert auto_folds(families, {"prep": False}, 6) == {"regen"}, "a family the operator unfolded stays open"
