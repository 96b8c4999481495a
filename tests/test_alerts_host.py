"""The run watches itself (issue 44): with no front end attached, the supervisor evaluates every alert rule from
the run's files, records each episode in ``RUN/alerts.jsonl`` and runs the plan's ``[alerts] command`` on the
executing host — once per episode, also across a SIGKILLed supervisor — and ``aerie status`` shows the records.
Real supervisors, real stage processes, real hooks (``/bin/sh``)."""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from console.cli import main as cli_main
from console.headless import run_headless
from console.transport import LocalTransport
from pipeline.run.alerts import record
from pipeline.run.rundir import audit
from pipeline.run.rundir.layout import RunDir, read_json
from tests.runs import kill_run_stages, make_run, stage_state, start_supervisor, stop, wait_for, write_plan

POLL = 0.5  # the supervisors' cycle here
HOOK = 'echo "$AERIE_ALERT_ID|$AERIE_ALERT_KIND|$AERIE_ALERT_STAGE|$AERIE_ALERT_ATTEMPT" >> {log}'


def hook_lines(log: Path) -> list[list[str]]:
    return [ln.split("|") for ln in log.read_text().splitlines()] if log.exists() else []


def records(run: RunDir) -> list[record.AlertRecord]:
    return sorted(record.read(run.root).values(), key=lambda r: r.id)


def status_json(run_root: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["status", str(run_root), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_stage_failing_after_its_front_end_is_gone_fires_the_hook_once_and_status_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's acceptance: ``aerie run PLAN --detach``, a stage that fails a few seconds later."""
    log = tmp_path / "hook.out"
    plan = write_plan(
        tmp_path,
        f"""
        [run]
        name = "lonely"
        dir = "run"
        [alerts]
        command = '{HOOK.format(log=log)}'
        [[stage]]
        id = "prep"
        command = "echo preparing"
        [[stage]]
        id = "bad"
        after = ["prep"]
        command = "sleep 3; echo about to fail; exit 3"
        """,
    )
    assert cli_main(["run", str(plan), "--detach"]) == 0
    out = capsys.readouterr()
    run = RunDir(out.out.splitlines()[0])
    assert "aerie watch" in out.err and "aerie attach" in out.err
    wait_for(lambda: (read_json(run.state_path) or {}).get("done"), 60, "the run to finish")
    wait_for(lambda: hook_lines(log), 20, "the hook")
    time.sleep(2 * POLL + 1)  # nothing more comes
    assert hook_lines(log) == [["1", "stage-failed", "bad", "1"]]
    (rec,) = records(run)
    assert (rec.kind, rec.stage, rec.attempt) == ("stage-failed", "bad", 1)
    assert "bad attempt 1 failed: exit 3: about to fail" in rec.text
    finished_at = (read_json(run.stage("bad").exit) or {}).get("t") or 0.0
    slack = 2.0  # two shared cores under load
    assert 0 <= rec.raised_at - finished_at <= 2 * POLL + slack, ("raised late", rec.raised_at - finished_at)
    assert [(d.status, d.rc) for d in rec.hooks] == [("done", 0)], "the delivery is recorded with its rc"
    assert stat.S_IMODE(os.stat(record.path_of(run.root)).st_mode) == 0o600
    lines = status_json(run.root, capsys)
    (alerts,) = [d["alerts"] for d in lines if "alerts" in d]
    assert [(a["id"], a["kind"], a["stage"], a["open"]) for a in alerts] == [(1, "stage-failed", "bad", True)]
    assert alerts[0]["hooks"][0]["rc"] == 0
    capsys.readouterr()
    assert cli_main(["status", str(run.root)]) == 0
    text = capsys.readouterr().out
    assert "alerts: 1 open, 0 cleared" in text and "stage-failed" in text, text
    out_h = io.StringIO()  # headless mode prints the same record
    assert run_headless(LocalTransport(str(run.root)), out=out_h, poll_s=0.2) == 1
    assert "alert #1 stage-failed bad: bad attempt 1 failed: exit 3" in out_h.getvalue()


STALL_STAGE = (
    "import time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "ctx.progress(1, 10, 'steps')\ntime.sleep(120)\n"
)
NAN_STAGE = (
    "import time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "for i in range(5):\n    ctx.metric('loss', 3.0 - 0.1 * i, step=i)\n    ctx.progress(i + 1, 100, 'steps')\n"
    "ctx.metric('loss', float('nan'), step=5)\n"
    "for i in range(6, 400):\n    ctx.progress(i, 400, 'steps')\n    time.sleep(0.3)\n"
)


def _two_stage_plan(tmp_path: Path, log: Path, stall_s: float, extra: str = "", hook: str = HOOK) -> RunDir:
    (tmp_path / "stall.py").write_text(STALL_STAGE)
    (tmp_path / "nan.py").write_text(NAN_STAGE)
    return make_run(
        tmp_path,
        f"""
        [run]
        name = "odd"
        dir = "run"
        [alerts]
        command = '{hook.format(log=log)}'
        stall_minutes = {stall_s / 60}
        {extra}
        [[stage]]
        id = "quiet"
        command = "{sys.executable} {tmp_path / "stall.py"}"
        kill_grace_s = 1
        [[stage]]
        id = "trainer"
        command = "{sys.executable} {tmp_path / "nan.py"}"
        kill_grace_s = 1
        """,
    )


@pytest.mark.slow
def test_a_stalled_and_a_nan_loss_stage_each_fire_the_hook_once_within_their_threshold(
    tmp_path: Path,
) -> None:
    log = tmp_path / "hook.out"
    stall_s = 4.0
    run = _two_stage_plan(tmp_path, log, stall_s)
    sup = start_supervisor(run, poll=POLL)
    try:
        wait_for(
            lambda: {k for _, k, *_ in hook_lines(log)} >= {"stalled", "loss-nonfinite"}, 40, "both hooks"
        )
        time.sleep(stall_s + 3 * POLL)  # a second threshold: still once each
        kinds = sorted(k for _, k, *_ in hook_lines(log))
        assert kinds == ["loss-nonfinite", "stalled"], hook_lines(log)
        by_kind = {r.kind: r for r in records(run)}
        stalled, nan = by_kind["stalled"], by_kind["loss-nonfinite"]
        assert stalled.stage == "quiet" and nan.stage == "trainer"
        last_progress = max(
            e["t"]
            for e in map(json.loads, run.stage("quiet").events.read_text().splitlines())
            if e["type"] == "progress"
        )
        slack = 2.0  # two shared cores under load: the stall's clock starts at its last report
        assert stalled.raised_at <= last_progress + stall_s + 2 * POLL + slack, (
            stalled.raised_at - last_progress
        )
        nan_t = next(
            e["t"]
            for e in map(json.loads, run.stage("trainer").events.read_text().splitlines())
            if e["type"] == "metric" and e.get("step") == 5
        )
        assert nan.raised_at <= nan_t + 2 * POLL + slack, nan.raised_at - nan_t
        assert "loss = nan at step 5" in nan.evidence
        assert "last progress 1/10 steps" in " ".join(stalled.evidence)
    finally:
        stop(sup)
        kill_run_stages(run)


@pytest.mark.slow
def test_a_supervisor_sigkilled_mid_episode_neither_repeats_nor_loses_an_alert(tmp_path: Path) -> None:
    log = tmp_path / "hook.out"
    # a slow hook: the supervisor is killed while it runs
    run = _two_stage_plan(tmp_path, log, 3.0, extra="timeout_s = 20", hook="sleep 2; " + HOOK)
    sup = start_supervisor(run, poll=POLL)
    try:
        wait_for(
            lambda: (
                any(r.kind == "stalled" and r.hooks for r in records(run))
                and any(r.kind == "loss-nonfinite" for r in records(run))
            ),
            30,
            "the stalled alert's hook and the NaN alert",
        )
        os.kill(sup.pid, signal.SIGKILL)  # mid-episode, its hook still running
        sup.wait(10)
        open_before = {r.id for r in records(run) if r.open}
        sup = start_supervisor(run, poll=POLL)
        time.sleep(3.0 + 4 * POLL)  # a whole threshold and more under the new supervisor
        after = records(run)
        episodes = [(r.kind, r.stage) for r in after]
        assert sorted(episodes) == sorted(set(episodes)), f"an episode raised twice: {episodes}"
        assert {("stalled", "quiet"), ("loss-nonfinite", "trainer")} <= set(episodes), episodes
        assert open_before <= {r.id for r in after if r.open}, "the restart ended an episode that goes on"
        stalled = [r for r in after if r.kind == "stalled"]
        wait_for(
            lambda: any(d.status == "done" for r in records(run) if r.kind == "stalled" for d in r.hooks),
            20,
            "the hook's end, recorded by its deliverer",
        )
        ids = [row[0] for row in hook_lines(log)]
        assert sorted(ids) == sorted(set(ids)), f"a hook ran twice: {hook_lines(log)}"
        assert str(stalled[0].id) in ids
    finally:
        stop(sup)
        kill_run_stages(run)


@pytest.mark.slow
def test_an_alert_recorded_but_not_delivered_when_the_supervisor_died_is_delivered_by_the_next(
    tmp_path: Path,
) -> None:
    """SIGKILLed between writing the record and starting its hook: the next supervisor delivers it, once."""
    log = tmp_path / "hook.out"
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "r"
        dir = "run"
        [alerts]
        command = '{HOOK.format(log=log)}'
        [[stage]]
        id = "bad"
        command = "exit 4"
        """,
    )
    raised = record.AlertRecord(1, "stage-failed:bad:1", "stage-failed", "bad", 1, "bad failed", "x", [], 1.0)
    record.append(run.root, [record.raised_line(raised)])
    sup = start_supervisor(run, poll=POLL)
    try:
        wait_for(lambda: (read_json(run.state_path) or {}).get("done"), 30, "the run to finish")
        wait_for(lambda: hook_lines(log), 20, "the hook")
        time.sleep(1)
        assert hook_lines(log) == [["1", "stage-failed", "bad", "1"]], "delivered once, not raised again"
        assert len(records(run)) == 1
    finally:
        stop(sup)


@pytest.mark.slow
def test_a_hanging_hook_is_killed_at_its_timeout_and_recorded_while_the_supervisor_goes_on(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "pids"
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "r"
        dir = "run"
        [alerts]
        command = "sleep 300 & echo $$ $! > {pidfile}; wait"
        timeout_s = 8
        [[stage]]
        id = "bad"
        command = "exit 4"
        [[stage]]
        id = "long"
        command = "sleep 2"
        """,
    )
    sup = start_supervisor(run, poll=POLL)
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text().endswith("\n"), 20, "the hook to start")
        # the loop goes on while the hook hangs: it sees the other stage finish long before the hook's timeout
        wait_for(lambda: stage_state(run, "long").get("state") == "succeeded", 6, "the other stage's end")
        (rec,) = records(run)
        assert [d.status for d in rec.hooks] == ["started"], "the hook still hangs meanwhile"
        wait_for(lambda: any(d.status == "timeout" for r in records(run) for d in r.hooks), 20, "the timeout")
        (rec,) = records(run)
        assert [d.status for d in rec.hooks] == ["timeout"] and rec.hooks[0].rc is None
        for pid in map(int, pidfile.read_text().split()):
            wait_for(lambda pid=pid: not _alive(pid), 10, f"hook process {pid} gone")
    finally:
        stop(sup)
        kill_run_stages(run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_ack_and_silence_are_audited_control_actions_on_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, '[run]\nname = "r"\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')
    for n in (1, 2):
        rec = record.AlertRecord(n, f"stalled:a:1:t{n}", "stalled", "a", 1, "a stalled", "x", [], 1.0)
        record.append(run.root, [record.raised_line(rec)])
    assert cli_main(["ack", str(run.root), "1"]) == 0
    assert "alert #1 (stalled on a) acknowledged" in capsys.readouterr().out
    assert cli_main(["ack", str(run.root), "1"]) == 3, "twice: refused, naming who did it"
    assert "was acknowledged by" in capsys.readouterr().err
    assert cli_main(["silence", str(run.root), "2"]) == 0
    assert cli_main(["ack", str(run.root), "9"]) == 2
    assert "no alert '9'" in capsys.readouterr().err
    book = record.read(run.root)
    assert book[1].acked_by == audit.identity() and book[1].acked_at and not book[1].silenced
    assert book[2].silenced and book[2].acked_by == audit.identity()
    entries = [json.loads(x) for x in (run.root / "audit.jsonl").read_text().splitlines()]
    assert [(e["action"], e["outcome"]) for e in entries] == [
        ("ack", "done"),
        ("ack", "refused"),
        ("silence", "done"),
        ("ack", "refused"),
    ]
    assert all(e["via"] == "cli" for e in entries)


CONSOLE_PLAN = """
    [run]
    name = "three"
    dir = "run"
    [alerts]
    stall_minutes = {stall}
    [[stage]]
    id = "bad"
    command = "while [ ! -e {gate}1 ]; do sleep 0.05; done; echo about to fail; exit 3"
    [[stage]]
    id = "quiet"
    command = "{py} {script} {gate}2"
    kill_grace_s = 1
"""
# Reports progress once its gate exists, then falls silent: an operator command is stalled only after a first
# report, so the test decides which consoles are attached when the stall is raised.
GATED_STALL_STAGE = (
    "import os, sys, time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"
    "ctx.progress(1, 10, 'steps')\ntime.sleep(120)\n"
)


def _alert_list(app: object) -> list[tuple[int, str, str, bool, str | None]]:
    from console.app import AerieApp

    assert isinstance(app, AerieApp)
    return [(r.id, r.kind, r.stage, r.open, r.acked_by) for r in app.model.alerts.ordered()]


@pytest.mark.slow
async def test_three_consoles_attached_at_different_times_list_the_same_alerts(tmp_path: Path) -> None:
    """Each console reads the run's records: the one attached first, one attached after the failure, one after
    the stall; an acknowledgement from the last shows in all three, and the board marks the alerted stages."""
    from console.app import AerieApp
    from console.screens.alerts import AlertsScreen
    from console.transport import LocalTransport
    from console.widgets.board import StageBoard
    from tests.screen_text import svg_rows
    from tests.test_console import until

    (tmp_path / "stall.py").write_text(GATED_STALL_STAGE)
    gate = tmp_path / "go"  # go1 lets "bad" fail, go2 lets "quiet" report and then stall
    run = make_run(
        tmp_path,
        CONSOLE_PLAN.format(stall=4 / 60, py=sys.executable, script=tmp_path / "stall.py", gate=gate),
    )
    sup = start_supervisor(run, poll=POLL)
    apps = [AerieApp(LocalTransport(str(run.root)), poll_s=0.2, user_config={}) for _ in range(3)]
    try:
        async with apps[0].run_test(size=(120, 30)) as p1:
            await until(p1, lambda: apps[0].alerts.seen is not None, 30, "console 1 attached to the alerts")
            Path(f"{gate}1").touch()
            await until(p1, lambda: len(_alert_list(apps[0])) >= 1, 30, "the failure's alert in console 1")
            async with apps[1].run_test(size=(120, 30)) as p2:
                await until(
                    p2, lambda: apps[1].alerts.seen is not None, 30, "console 2 attached to the alerts"
                )
                Path(f"{gate}2").touch()
                await until(p2, lambda: len(_alert_list(apps[1])) >= 2, 30, "the stall's alert in console 2")
                async with apps[2].run_test(size=(100, 30)) as p3:
                    await until(p3, lambda: len(_alert_list(apps[2])) >= 2, 20, "both in console 3")
                    board = apps[2].query_one(StageBoard)
                    await until(p3, lambda: board.selected_key is not None, what="a stage selected")
                    while board.selected_key != "quiet":
                        await p3.press("down")
                    await p3.press("K")  # acknowledge the selected stage's alert: a control action
                    await until(
                        p3,
                        lambda: all(any(a[4] for a in _alert_list(x)) for x in apps),
                        20,
                        "the ack in every console",
                    )
                    lists = [_alert_list(a) for a in apps]
                    assert lists[0] == lists[1] == lists[2], lists
                    assert {(k, s) for _, k, s, *_ in lists[0]} == {
                        ("stage-failed", "bad"),
                        ("stalled", "quiet"),
                    }
                    assert [a[4] is not None for a in lists[0] if a[1] == "stalled"] == [True]
                    rows = "\n".join(svg_rows(apps[2].export_screenshot()))
                    failed_row = next(r for r in rows.splitlines() if "bad" in r and "failed" in r)
                    assert "⚠ exit 3" in failed_row and "⚠ stalled" in rows, rows  # the mark, then why
                    await p3.press("a")
                    await until(p3, lambda: isinstance(apps[2].screen, AlertsScreen), what="the alert list")
                    text = "\n".join(svg_rows(apps[2].export_screenshot()))
                    assert "2 open" in text and "acknowledged by" in text, text
        assert apps[0].alerts.announced == 2, "console 1 was there for both: a toast each"
        assert apps[1].alerts.announced == 1 and apps[2].alerts.announced == 0, (
            "old news is listed, not toasted"
        )
        entries = [json.loads(x) for x in (run.root / "audit.jsonl").read_text().splitlines()]
        assert [(e["action"], e["stage"], e["outcome"], e["via"]) for e in entries] == [
            ("ack", "quiet", "done", "console")
        ]
    finally:
        stop(sup)
        kill_run_stages(run)
