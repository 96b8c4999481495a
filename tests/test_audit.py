"""The audit log (``RUN/audit.jsonl``): control actions through the real CLI on a real run are recorded with
who, where from and the outcome; a torn last line (a crash mid-write) is reported and never spoils the
entries around it; the console's audit view shows the same."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from console.app import AerieApp
from console.audit_trail import AuditTrail
from console.cli import main as cli_main
from console.headless import follow
from console.screens.alerts import AlertsScreen
from console.screens.audit import AuditScreen
from console.transport import CtlResult, LocalTransport
from pipeline.run.alerts import record as alert_record
from pipeline.run.rundir import audit
from pipeline.run.rundir.layout import RunDir
from pipeline.run.supervise import ctl
from pipeline.run.supervise.liveness import lock_holders
from pipeline.run.supervise.run_setup import supervisor_alive
from tests.runs import finished_run, kill_run_stages, make_run, start_supervisor, stop, wait_done, wait_for
from tests.test_console import WORKER, until

ME = audit.identity()


@pytest.fixture
def live_run(tmp_path: Path):  # noqa: ANN201
    (tmp_path / "w.py").write_text(WORKER)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "audited"
        dir = "run"
        [[stage]]
        id = "work"
        command = "{sys.executable} {tmp_path / "w.py"} 600"
        [[stage]]
        id = "after-work"
        command = "true"
        after = ["work"]
    """,
    )
    sup = start_supervisor(run)
    yield run
    stop(sup)
    kill_run_stages(run)


def settled(root: Path) -> RunDir:
    """A finished run with its state.json (its supervisor ran and exited): a read-only console starts none."""
    run = finished_run(root)
    sup = start_supervisor(run)
    wait_done(run)
    sup.wait(20)
    return run


def entries(run: RunDir) -> list[dict]:
    """The audit log's whole lines (one being written at this moment has no newline yet)."""
    text = (run.root / audit.AUDIT_FILE).read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_cli_actions_on_a_real_run_are_recorded_with_who_where_from_and_outcome(
    live_run: RunDir, capsys: pytest.CaptureFixture[str]
) -> None:
    run = live_run
    wait_for(
        lambda: (run.root / "state.json").exists() and "running" in (run.root / "state.json").read_text()
    )
    root = str(run.root)
    assert cli_main(["pause", root, "work"]) == 0
    assert cli_main(["kill", root, "after-work"]) == 3  # not running: refused by the supervisor
    assert cli_main(["retry", root, "work", "--fresh"]) == 3  # paused, not failed
    assert cli_main(["resume", root, "work"]) == 0
    assert cli_main(["skip", root, "no-such-stage"]) == 2  # refused before it was queued
    # no answer in time: recorded as timed out, and the supervisor's line follows when it acts. The
    # supervisor is frozen while ctl waits, so its answer cannot come first (under load it did: "done"
    # was recorded before "timed out").
    (sup_pid,) = lock_holders(run.root)
    os.kill(sup_pid, signal.SIGSTOP)
    try:
        assert (
            ctl.main(
                [root, "skip", "after-work", "--timeout", "0", "--via", "console", "--who", "ana@laptop"]
            )
            == 4
        )
    finally:
        os.kill(sup_pid, signal.SIGCONT)
    wait_for(lambda: len(entries(run)) == 7, 10, "the supervisor's line for the queued skip")

    got = [
        (e["action"], e["stage"], e["outcome"], e["via"], e["who"], e.get("fresh", False))
        for e in entries(run)
    ]
    assert got == [
        ("pause", "work", "done", "cli", ME, False),
        ("kill", "after-work", "refused", "cli", ME, False),
        ("retry", "work", "refused", "cli", ME, True),
        ("resume", "work", "done", "cli", ME, False),
        ("skip", "no-such-stage", "refused", "cli", ME, False),
        ("skip", "after-work", "timed out", "console", "ana@laptop", False),
        ("skip", "after-work", "done", "console", "ana@laptop", False),
    ]
    lines = entries(run)
    assert "not running" in lines[1]["message"] and "only failed, killed or skipped" in lines[2]["message"]
    assert lines[4]["message"] == "unknown stage 'no-such-stage'"
    assert all(e["t"].endswith("Z") and e["t"][:4].isdigit() for e in lines)
    assert lines[5]["account"] == ME  # the account ctl ran as, since it differs from the operator named

    capsys.readouterr()
    assert cli_main(["status", root]) == 0
    out = capsys.readouterr().out
    assert "audit log (last 7 of 7" in out
    assert f"{ME} via cli  retry --fresh work  refused: work is paused" in out
    assert cli_main(["status", root, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["audit"]["total"] == 7 and last["audit"]["entries"][-1]["outcome"] == "done"


def test_a_torn_last_line_is_reported_and_the_next_entry_starts_on_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = finished_run(tmp_path / "r")
    audit.append(run.root, audit.entry("kill", "train", "done", via="console", who="ana@laptop"))
    whole = json.dumps(audit.entry("pause", "bench", "done", via="cli", who="bo@desk")) + "\n"
    with open(run.root / audit.AUDIT_FILE, "ab") as fh:  # a crash cut this write short
        fh.write(whole.encode()[:37])

    read, total = audit.read_tail(run.root)
    assert [e.action for e in read.entries] == ["kill"] and total == 1
    assert len(read.problems) == 1 and "line 2: torn last line" in read.problems[0]
    assert cli_main(["status", str(run.root)]) == 0
    out, err = capsys.readouterr()
    assert "ana@laptop via console  kill train  done" in out and "torn last line" in err

    audit.append(run.root, audit.entry("retry", "train", "refused", "train is running", who="cy@box"))
    read, total = audit.read_tail(run.root)
    assert [(e.action, e.who) for e in read.entries] == [("kill", "ana@laptop"), ("retry", "cy@box")]
    assert len(read.problems) == 1 and "line 2: unreadable entry skipped" in read.problems[0]
    assert total == 3


async def test_the_console_audit_view_lists_entries_and_names_a_torn_line(tmp_path: Path) -> None:
    run = settled(tmp_path / "r")
    for i, (action, outcome) in enumerate((("kill", "done"), ("retry", "refused"), ("pause", "timed out"))):
        audit.append(
            run.root,
            audit.entry(
                action, f"prep.{i}", outcome, "why" if outcome != "done" else "", via="browser", who="ana@x"
            ),
        )
    with open(run.root / audit.AUDIT_FILE, "ab") as fh:
        fh.write(b'{"t": "2026-')  # torn by a crash
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        await pilot.press("A")
        await until(pilot, lambda: isinstance(app.screen, AuditScreen), what="the audit view")
        screen = app.screen
        assert isinstance(screen, AuditScreen)
        await until(pilot, lambda: screen.query_one("DataTable").row_count == 3, what="three rows")
        table = screen.query_one("DataTable")
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(3)]
        assert rows[1][1:5] == ["ana@x", "browser", "retry", "prep.1"] and rows[1][5] == "refused: why"
        title = str(screen.query_one("#audit-title").content)
        assert "3 entries · 2 refused or timed out" in title and "line 4: torn last line" in title
        audit.append(run.root, audit.entry("skip", "bench", "done", via="cli", who="bo@desk"))
        await until(pilot, lambda: table.row_count == 4, what="the new entry")
        assert str(table.get_row_at(3)[3]) == "skip" and table.cursor_row == 3  # following the newest
        why = "prep.5 is running: " + "a refusal that says at length why it was refused " * 6 + "THE END"
        audit.append(run.root, audit.entry("retry", "prep.5", "refused", why, via="cli", who="bo@desk"))
        await until(pilot, lambda: table.row_count == 5, what="the long refusal")
        cell = str(table.get_row_at(4)[5])
        assert cell.endswith("…") and "THE END" not in cell, "a long reason is cut with …, inside the screen"
        assert len(cell) < 140 - 30
        await until(pilot, lambda: "THE END" in str(screen.query_one("#audit-reason").content), what="reason")
        assert "retry prep.5: refused: prep.5 is running" in str(screen.query_one("#audit-reason").content)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, AuditScreen), what="back to the board")


async def test_the_console_trail_reads_only_the_end_of_a_long_log(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    line = json.dumps(audit.entry("pause", "s", "done", who="x@y")) + "\n"
    (root / audit.AUDIT_FILE).write_text(line * (2 * audit.TAIL_BYTES // len(line)))
    trail = AuditTrail(LocalTransport(str(root)))
    assert await trail.poll()
    assert trail.skipped_head and not trail.problems
    assert 0 < len(trail.entries) <= audit.TAIL_BYTES // len(line) + 1
    os.truncate(root / audit.AUDIT_FILE, 0)  # replaced by a shorter file: read again from its start
    audit.append(root, audit.entry("kill", "s", "done", who="x@y"))
    assert await trail.poll()
    assert [e.action for e in trail.entries] == ["kill"]


# ------------------------------------------------------------------------------ read-only watchers
class Recording(LocalTransport):
    """The real local transport, noting every ``ctl`` it is asked to send."""

    def __init__(self, run_root: str) -> None:
        super().__init__(run_root)
        self.sent: list[tuple[str, ...]] = []

    async def ctl(self, *args: str) -> CtlResult:
        self.sent.append(args)
        return await super().ctl(*args)

    def beyond_reads(self) -> list[tuple[str, ...]]:
        """What was sent besides the two reads that start nothing: ``ctl liveness`` (is the supervisor up?) and
        ``ctl status`` (every stage from its files: a read-only console asks it when the liveness answer comes
        before its first snapshot, as under load in CI). Not even ``ensure``, which restarts a supervisor."""
        return [c for c in self.sent if c[0] not in ("liveness", "status")]


async def test_a_read_only_console_refuses_every_control_key_and_sends_nothing(tmp_path: Path) -> None:
    run = settled(tmp_path / "r")
    before = sorted(p.name for p in run.root.iterdir())
    transport = Recording(str(run.root))
    app = AerieApp(transport, poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        await pilot.press("home", "down", "down")  # prep.deepswe-kimi: a killed stage, retry-able
        header = str(app.query_one("#header").content)
        assert header.startswith("READ-ONLY ")
        footer_actions = {b.binding.action for b in app.screen.active_bindings.values() if b.binding.show}
        assert not footer_actions & {"pause", "kill", "retry"}, "the footer offers no control"
        for key in ("p", "k", "r", "R", "s", "F", "K", "S"):
            app.clear_notifications()
            await pilot.press(key)
            await pilot.pause(0.1)
            notes = [n.message for n in app._notifications]
            assert len(notes) == 1 and notes[0].startswith("read-only: this console only watches"), (
                key,
                notes,
            )
            assert "prep.deepswe-kimi was not sent" in notes[0]
            assert app.screen is app.screen_stack[0], f"{key}: no confirmation dialog"
        app.clear_notifications()
        app.action_retry_fresh()  # the command palette calls the actions directly: refused the same way
        await pilot.press("d")  # and on another screen
        await pilot.press("k")
        await pilot.pause(0.2)
        assert [n.message.split(";")[0] for n in app._notifications] == [
            "read-only: this console only watches"
        ] * 2
    assert sorted(p.name for p in run.root.iterdir()) == before, (
        "nothing queued, no supervisor, no audit line"
    )

    assert transport.beyond_reads() == [], "nothing but the liveness question and the status read"
    assert ("liveness",) in transport.sent, "it asked whether the supervisor is up"

    headless = Recording(str(run.root))
    out = io.StringIO()
    assert await follow(headless, out=out, poll_s=0.1, timeout_s=20, read_only=True) == 1
    assert "prep.sharegpt" in out.getvalue() and "failed" in out.getvalue()
    assert headless.sent == [], "headless and read-only: nothing sent either"


def raise_alerts(run: RunDir) -> None:
    """Beside the run's own alert (#1: prep.sharegpt failed, raised by its supervisor), #2: a stall of
    prep.deepswe-kimi, cleared, as the supervisor's watcher writes them."""
    assert [(r.id, r.kind, r.stage) for r in alert_record.read(run.root).values()] == [
        (1, "stage-failed", "prep.sharegpt")
    ]
    sid = "prep.deepswe-kimi"
    rec = alert_record.AlertRecord(
        2, f"stalled:{sid}:1:t2", "stalled", sid, 1, f"{sid} stalled", "x", [], 2.0
    )
    alert_record.append(run.root, [alert_record.raised_line(rec), alert_record.cleared_line(2, 3.0)])


async def _alert_list(app: AerieApp, pilot) -> AlertsScreen:  # noqa: ANN001
    await until(pilot, lambda: app.model.alerts.loaded and len(app.model.alerts.book) == 2, what="the alerts")
    await pilot.press("a")
    await until(pilot, lambda: isinstance(app.screen, AlertsScreen), what="the alert list")
    assert isinstance(app.screen, AlertsScreen)
    return app.screen


async def test_k_and_s_in_the_alert_list_act_on_the_highlighted_alert_audited_and_seen_by_another_console(
    tmp_path: Path,
) -> None:
    """The alert list's K acknowledges, and S silences, the highlighted alert (not the board's selection):
    the ack line lands in RUN/alerts.jsonl and an audit line says who, from the console; a second console,
    attached before, lists it acknowledged. A read-only console refuses both and writes nothing."""
    run = settled(tmp_path / "r")
    raise_alerts(run)
    watcher = AerieApp(
        LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={}, read_only=True
    )
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    try:
        async with watcher.run_test(size=(120, 30)) as wp:
            listed = await _alert_list(watcher, wp)
            assert [a.id for a in listed.alerts] == [1, 2], "open first"
            for key in ("K", "S"):
                watcher.clear_notifications()
                await wp.press(key)
                await wp.pause(0.1)
                notes = [n.message for n in watcher._notifications]
                assert len(notes) == 1 and "alert #1 was not sent" in notes[0], notes
            assert not (run.root / audit.AUDIT_FILE).exists(), "the read-only console sent nothing"
            async with app.run_test(size=(120, 30)) as pilot:
                screen = await _alert_list(app, pilot)
                await pilot.press("down", "K")  # #2, on prep.deepswe-kimi: not the board's selected stage
                await until(
                    pilot, lambda: alert_record.read(run.root)[2].acked_by is not None, what="the ack"
                )
                await until(
                    pilot,
                    lambda: "acknowledged by" in str(screen._entry(screen.alerts[1])),
                    what="the list to show the ack",
                )
                assert [a.id for a in screen.alerts] == [1, 2], "the list keeps its order"
                await pilot.press("up", "S")  # #1: silenced
                await until(pilot, lambda: alert_record.read(run.root)[1].silenced, what="the silence")
                await until(
                    wp, lambda: watcher.model.alerts.book[1].silenced, what="the silence in console 2"
                )
        book = alert_record.read(run.root)
        assert (book[2].acked_by, book[2].silenced, book[1].acked_by) == (ME, False, ME)
        assert watcher.model.alerts.book[2].acked_by == ME, "the other console sees it acknowledged"
        got = [(e["action"], e["stage"], e["outcome"], e["via"], e["who"]) for e in entries(run)]
        assert got == [
            ("ack", "prep.deepswe-kimi", "done", "console", ME),
            ("silence", "prep.sharegpt", "done", "console", ME),
        ]
        assert entries(run)[0]["message"] == "alert #2 (stalled on prep.deepswe-kimi) acknowledged"
    finally:
        wait_for(lambda: not supervisor_alive(run), 30, "the supervisor the console ensured to exit")


async def _screen_until(ws, want: str, timeout: float = 60.0) -> str:  # noqa: ANN001
    """Read the browser session's terminal output until ``want`` shows (escape sequences dropped)."""
    import re
    import time

    import aiohttp

    screen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and want not in screen:
        try:
            msg = await ws.receive(timeout=2)
        except TimeoutError:
            continue
        if msg.type == aiohttp.WSMsgType.BINARY:
            screen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", msg.data.decode(errors="replace"))
        elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            break
    assert want in screen, f"{want!r} never showed: {screen[-1500:]!r}"
    return screen


@pytest.mark.slow  # two browser sessions, each a console process started cold (~4 s each on 2 cores)
async def test_serve_gives_the_view_token_a_read_only_console_and_the_control_token_control(
    tmp_path: Path,
) -> None:
    import signal
    import subprocess

    import aiohttp

    from tests.runs import ROOT
    from tests.test_console_ux import free_port

    run = settled(tmp_path / "r")
    control, view = "c0ntrol-" + "x" * 16, "v1ew-only-" + "y" * 16
    (tmp_path / "control").write_text(control)
    (tmp_path / "view").write_text(view)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp_path / "none.toml"))
    server = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "serve", str(run.root), "--port", str(port)]
        + ["--token-file", str(tmp_path / "control"), "--view-token-file", str(tmp_path / "view")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            for _ in range(200):
                try:
                    async with http.get(f"{url}/session") as resp:
                        assert resp.status == 401, "a console needs a token or key once a view token exists"
                        break
                except aiohttp.ClientConnectionError:
                    assert server.poll() is None, server.stderr.read() if server.stderr else ""
                    await asyncio.sleep(0.2)
            async with http.post(f"{url}/session", data={"token": view}) as resp:  # the page's login
                assert resp.status == 200 and not resp.cookies  # a key for the page to hold, no cookie
                view_key = (await resp.json())["session"]
            async with http.get(f"{url}/session", headers={"X-Aerie-Session": view_key}) as resp:
                assert (await resp.json())["read_only"] is True

            async with http.ws_connect(f"{url}/ws?width=120&height=36&token={view}") as ws:
                await _screen_until(ws, "READ-ONLY")
                await ws.send_json(["stdin", "\x1b[B"])  # a stage, not the family row
                await ws.send_json(["stdin", "r"])
                await _screen_until(ws, "read-only: this console only watches")
            assert not (run.root / "requests").exists() and not (run.root / audit.AUDIT_FILE).exists()

            async with http.ws_connect(f"{url}/ws?width=120&height=36&token={control}") as ws:
                screen = await _screen_until(ws, "prep.sharegpt")
                assert "READ-ONLY" not in screen
                await ws.send_json(["stdin", "\x1b[H\x1b[B"])  # Home (attach selected a stage), then Down
                await ws.send_json(
                    ["stdin", "r"]
                )  # retry a succeeded stage: sent, and refused by the supervisor
                # The run had finished, so ctl first starts a supervisor; on loaded cores that can take longer
                # than ctl's 15 s wait, and ctl then records "timed out" before the supervisor's own line.
                wait_for(
                    lambda: (
                        (run.root / audit.AUDIT_FILE).exists()
                        and any(e["outcome"] != "timed out" for e in entries(run))
                    ),
                    60,
                    "the supervisor's answer to the browser's action in the audit log",
                )
            *waited, line = entries(run)
            assert (line["action"], line["stage"], line["via"], line["outcome"]) == (
                "retry",
                "prep.swe-agent",
                "browser",
                "refused",
            )
            assert [(e["action"], e["via"], e["outcome"]) for e in waited] in (
                [],
                [("retry", "browser", "timed out")],
            )
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server we started, in its own session
        server.wait(20)
        wait_for(lambda: not supervisor_alive(run), 30, "the run's supervisor to exit (every stage finished)")


async def _type(browser, *keys: tuple[str, str, int]) -> None:  # noqa: ANN001
    """Keys typed into the page's terminal as a keyboard does: (key, code, virtual key code) each."""
    for key, code, vk in keys:
        shift = 8 if key.isupper() else 0
        await browser.send(
            "Input.dispatchKeyEvent",
            type="keyDown",
            key=key,
            code=code,
            text=key,
            windowsVirtualKeyCode=vk,
            modifiers=shift,
        )
        await browser.send(
            "Input.dispatchKeyEvent",
            type="keyUp",
            key=key,
            code=code,
            windowsVirtualKeyCode=vk,
            modifiers=shift,
        )
        await asyncio.sleep(0.3)


@pytest.mark.slow  # a browser, a server and a console, each started cold
async def test_an_alert_acknowledged_in_a_real_browser_is_recorded_and_audited_as_the_browsers(
    tmp_path: Path,
) -> None:
    """In a real headless Chromium on ``aerie serve``, the operator opens the alert list (a) and presses K: the
    run's alert record says who acknowledged it and when, the audit line says it came via the browser, and the
    list in the browser shows it acknowledged."""
    from tests.chromium import Chromium, chromium_path
    from tests.test_console_ux import free_port
    from tests.test_serve_guard import RECORD_WEBSOCKETS, browser_log_in, generated_token, reap, start

    chromium_path()
    run = settled(tmp_path / "r")
    (alert,) = alert_record.read(run.root).values()
    assert (alert.kind, alert.stage, alert.acked_by) == ("stage-failed", "prep.sharegpt", None)
    port = free_port()
    server = start(tmp_path, run.root, port)
    token = generated_token(port)
    browser = await Chromium(tmp_path / "profile").start()
    try:
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=RECORD_WEBSOCKETS)
        await browser_log_in(browser, port, token)
        await browser.wait_eval("window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the board")
        await browser.eval("document.querySelector('.xterm-helper-textarea').focus(); true")
        await _type(browser, ("a", "KeyA", 65))
        await browser.wait_eval("window.__rx.includes('Alerts of this run')", 60, "the alert list")
        await _type(browser, ("K", "KeyK", 75))
        wait_for(
            lambda: alert_record.read(run.root)[alert.id].acked_by is not None,
            60,
            "the browser's ack in alerts.jsonl",
        )
        await browser.wait_eval("window.__rx.includes('acknowledged by')", 60, "the list showing the ack")
    finally:
        await browser.close()
        reap(server, {})
        wait_for(lambda: not supervisor_alive(run), 30, "the run's supervisor to exit (every stage finished)")
    acked = alert_record.read(run.root)[alert.id]
    assert acked.acked_by == ME and acked.acked_at and not acked.silenced
    (line,) = entries(run)
    assert (line["action"], line["stage"], line["outcome"], line["via"], line["who"]) == (
        "ack",
        "prep.sharegpt",
        "done",
        "browser",
        ME,
    )


def test_serve_refuses_contradictory_or_weak_watcher_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from console.browser import console_command

    run = finished_run(tmp_path / "r")
    (tmp_path / "t1").write_text("a" * 20)
    (tmp_path / "short").write_text("abc")
    serve = ["serve", str(run.root), "--port", "1"]
    assert cli_main([*serve, "--read-only", "--view-token-file", str(tmp_path / "t1")]) == 2
    assert "every console is read-only already" in capsys.readouterr().err
    assert (
        cli_main([*serve, "--view-token-file", str(tmp_path / "t1"), "--token-file", str(tmp_path / "t1")])
        == 2
    )
    assert "must differ from the control token" in capsys.readouterr().err
    assert cli_main([*serve, "--view-token-file", str(tmp_path / "short")]) == 2
    assert "--view-token-file" in capsys.readouterr().err
    # one slot could only be the control token's: watchers need two at least
    assert cli_main([*serve, "--view-token-file", str(tmp_path / "t1"), "--max-sessions", "1"]) == 2
    assert "the last slot is kept for the control token" in capsys.readouterr().err
    assert console_command("RUN", None, 1.0, read_only=True).endswith("--via browser --read-only")
    assert "--read-only" not in console_command("RUN", None, 1.0)


def test_a_request_queued_while_the_supervisor_exits_is_still_answered(tmp_path: Path) -> None:
    """A finished run's supervisor exits once it sees no request. One queued in that last moment found the lock
    held, so ctl started none: ctl now starts one when the lock is free again, and the operator gets the
    supervisor's answer rather than "timed out" (the flake CI once saw in the browser test above)."""
    import fcntl
    import threading

    run = settled(tmp_path / "r")
    stage = next(s for s in run.stage_ids() if s.startswith("prep.") and s != "prep.sharegpt")
    fd = os.open(run.lock_path, os.O_RDWR)  # stands in for the exiting supervisor's lock
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    got: list[tuple[int, str]] = []
    t = threading.Thread(target=lambda: got.append(ctl.request(run, "retry", stage, timeout_s=30)))
    t.start()
    try:
        wait_for(lambda: any(True for _ in run.pending_requests()), 10, "the queued request")
    finally:
        os.close(fd)  # the old supervisor is gone
    t.join(40)
    assert got and got[0][0] == ctl.EXIT_REFUSED, got  # answered by a new supervisor: a succeeded stage
    assert stage in got[0][1] or "succeeded" in got[0][1], got
    assert [e["outcome"] for e in entries(run)] == ["refused"]
