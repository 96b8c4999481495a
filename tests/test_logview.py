"""The log viewer as the operator drives it: the real console (Pilot) on real run directories.

Follow pauses when scrolling up and resumes with End/f while the log grows; search next/previous,
the regex filter, first error, wrap and timestamps change what is on screen; the server log opens
with L; a snapshot pins the look; a generated 5M-line log opens at its end and jumps to the top.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from console.app import AerieApp
from console.screens.logview import LogScreen
from console.transport import LocalTransport
from tests.runs import finished_run, kill_run_stages, make_run, start_supervisor, stop
from tests.test_console import until

LOG = "".join(
    f"2026-12-02 10:{i // 60 % 60:02d}:{i % 60:02d} INFO step {i} loss={1 + 1 / (i + 1):.4f}\n"
    for i in range(400)
)
LOG += (
    "2026-12-02 10:06:40 WARNING slow batch\nTraceback (most recent call last):\n"
    "  File \"train.py\", line 12, in <module>\nValueError: field 'conversations' missing\n"
)
LOG += "".join(f"after {i} " + ("x" * 150 if i == 3 else "") + "\n" for i in range(20))


def log_app(tmp: Path, body: str = LOG, stage: str = "prep.sharegpt") -> tuple[AerieApp, Path]:
    run = finished_run(tmp / "r")
    log = run.stage(stage).log
    log.write_text(body)
    return AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={}), log


async def open_log(pilot, app: AerieApp, stage: str = "prep.sharegpt") -> LogScreen:  # noqa: ANN001
    await until(pilot, lambda: app.model.loaded, what="the run")
    app.open_log(stage)
    await until(
        pilot,
        lambda: isinstance(app.screen, LogScreen) and app.screen.updates > 0 and app.screen.view.window,
        what="the log screen",
    )
    return app.screen  # type: ignore[return-value]


def screen_text(view) -> list[str]:  # noqa: ANN001
    return [view.render_line(y).text.rstrip() for y in range(view.page)]


async def test_follow_pauses_on_scroll_up_and_resumes_with_end(tmp_path: Path) -> None:
    app, log = log_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        scr = await open_log(pilot, app)
        view = scr.view
        total = view.total
        assert total == LOG.count("\n")
        assert view.following and screen_text(view)[-1].endswith("after 19")
        await pilot.press("up", "up")
        assert not view.following
        first = view.visible_first()
        with open(log, "a") as fh:
            fh.write("".join(f"late {i}\n" for i in range(100)))
        await until(pilot, lambda: view.total == total + 100, what="the growth indexed")
        await pilot.pause(0.2)
        assert view.visible_first() == first, "paused: the view stays where the operator is reading"
        assert "+100 new" in str(scr.query_one("#log-status").render())
        await pilot.press("end")
        await until(
            pilot, lambda: screen_text(view)[-1].endswith("late 99"), what="follow resumed at the end"
        )
        assert view.following
        with open(log, "a") as fh:
            fh.write("latest\n")
        await until(pilot, lambda: screen_text(view)[-1].endswith("latest"), what="following new lines")
        await pilot.press("g")
        await until(pilot, lambda: "step 0 " in screen_text(view)[0], what="the top")
        await pilot.press("f")
        await until(pilot, lambda: screen_text(view)[-1].endswith("latest"), what="f follows again")


async def test_a_failed_read_of_the_rows_asked_for_is_asked_again(tmp_path: Path) -> None:
    """Home on a long log while the read of those rows fails once (an SSH link that blipped): the pane is not
    left blank, the rows are read again on the next tick and the first line shows."""
    app, _log = log_app(tmp_path, "".join(f"old line {i}\n" for i in range(3000)))
    async with app.run_test(size=(120, 30)) as pilot:
        scr = await open_log(pilot, app)
        view = scr.view
        await until(pilot, lambda: view.total == 3000 and scr.index.caught_up, what="the log indexed")
        read_lines = scr.index.read_lines
        failed: list[int] = []

        async def flaky(first: int, count: int):  # noqa: ANN202
            if first == 0 and not failed:
                failed.append(first)
                raise OSError("Connection lost")
            return await read_lines(first, count)

        scr.index.read_lines = flaky  # type: ignore[method-assign]
        await pilot.press("g")
        await until(pilot, lambda: bool(failed), what="the failed read")
        await until(
            pilot, lambda: screen_text(view)[0].endswith("old line 0"), what="the first line, read again"
        )
        assert not view.following


async def test_search_filter_first_error_wrap_and_timestamps(tmp_path: Path) -> None:
    app, _log = log_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        scr = await open_log(pilot, app)
        view = scr.view
        await pilot.press("e")
        await until(pilot, lambda: view.found_line == 401, what="the traceback")
        assert not view.following
        assert any(t.endswith("Traceback (most recent call last):") for t in screen_text(view))
        await pilot.press("n")
        await until(pilot, lambda: view.found_line == 403, what="the next error line (ValueError)")
        await pilot.press("N")
        await until(pilot, lambda: view.found_line == 401, what="back to the traceback")

        await pilot.press("home")
        await pilot.press("slash", *"step 12", "enter")
        await until(pilot, lambda: view.found_line == 12, what="the first match from the top")
        await pilot.press("n")
        await until(pilot, lambda: view.found_line == 120, what="the next match")
        await pilot.press("N")
        await until(pilot, lambda: view.found_line == 12, what="the previous match")

        await pilot.press("ampersand", *"^after", "enter")
        await until(
            pilot, lambda: scr.filter is not None and scr.filter.done and view.total == 20, what="filtered"
        )
        await until(pilot, lambda: "after 0" in " ".join(screen_text(view)), what="only matching lines")
        shown = [t for t in screen_text(view) if t.strip()]
        assert shown and all("after" in t for t in shown)
        assert shown[0].split()[0] == "405"  # the line's own number in the file
        await pilot.press("escape")  # clears the filter first
        await until(pilot, lambda: scr.filter is None and view.total > 400, what="filter cleared")
        assert isinstance(app.screen, LogScreen)

        await pilot.press("g")
        await until(pilot, lambda: "10:00:00" in screen_text(view)[0], what="timestamps shown")
        await pilot.press("t")
        await until(
            pilot, lambda: screen_text(view)[0].split()[1:3] == ["INFO", "step"], what="timestamps hidden"
        )
        await pilot.press("t")
        await pilot.press("f")
        await until(pilot, lambda: screen_text(view)[-1].endswith("after 19"), what="the end")
        long_rows = [t for t in screen_text(view) if "xxxx" in t]
        assert len(long_rows) == 1
        await pilot.press("w")
        await until(pilot, lambda: len([t for t in screen_text(view) if "xxxx" in t]) == 2, what="wrapped")
        assert screen_text(view)[-1].endswith("after 19"), "wrapped and still following"
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, LogScreen), what="back to the board")


async def test_server_log_key_opens_the_serve_stage_log(tmp_path: Path) -> None:
    (tmp_path / "srv.py").write_text(
        "import time\nprint('server listening on 127.0.0.1:30000', flush=True)\ntime.sleep(60)\n"
    )
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "srv"
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "serve"
        command = "{sys.executable} {tmp_path / "srv.py"}"
        service = true
        kill_grace_s = 1
        [[stage]]
        id = "work"
        command = "sleep 60"
        kill_grace_s = 1
    """,
    )
    sup = start_supervisor(run)
    try:
        app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
        async with app.run_test(size=(120, 30)) as pilot:
            await until(
                pilot,
                lambda: app.model.stages.get("serve") and app.model.stages["serve"].state == "running",
                what="the server running",
            )
            await pilot.press("L")
            await until(pilot, lambda: isinstance(app.screen, LogScreen), what="the log screen")
            scr = app.screen
            assert scr.index.path == "stages/serve/stage.log"
            await until(
                pilot,
                lambda: any("server listening" in t for t in screen_text(scr.view)),
                what="the server's output",
            )
    finally:
        stop(sup)
        kill_run_stages(run)


def test_log_viewer_snapshot(snap_compare, tmp_path: Path) -> None:  # noqa: ANN001
    app, _log = log_app(Path("/tmp/aerie-logview-snapshot"))

    async def opened(pilot) -> None:  # noqa: ANN001
        scr = await open_log(pilot, app)
        await pilot.press("e")
        await until(pilot, lambda: scr.view.found_line == 401, what="the traceback")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(110, 30), run_before=opened)


@pytest.mark.slow
async def test_five_million_line_log_opens_at_its_end_and_jumps(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    log = run.stage("prep.sharegpt").log
    n = 5_000_000
    with open(log, "w") as fh:
        for b in range(0, n, 100_000):
            fh.write(
                "".join(f"2026-12-02 10:00:00 INFO step {i} loss=1.234\n" for i in range(b, b + 100_000))
            )
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.5, alerts=False, user_config={})
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="the run")
        t0 = time.monotonic()
        app.open_log("prep.sharegpt")
        await until(
            pilot,
            lambda: (
                isinstance(app.screen, LogScreen)
                and app.screen.updates > 0
                and app.screen.view.window
                and app.screen.index.caught_up
            ),
            timeout=120,
            what="the 5M-line log indexed",
        )
        scr: LogScreen = app.screen  # type: ignore[assignment]
        view = scr.view
        assert scr.index.lines == n
        await until(
            pilot, lambda: screen_text(view)[-1].endswith(f"step {n - 1} loss=1.234"), what="the end shown"
        )
        print(f"5M lines ({log.stat().st_size >> 20} MiB) indexed and shown in {time.monotonic() - t0:.2f}s")
        await pilot.press("home")
        await until(pilot, lambda: screen_text(view)[0].endswith("step 0 loss=1.234"), what="the first line")
        assert screen_text(view)[0].split()[0] == "1"
        await pilot.press("end")
        await until(
            pilot,
            lambda: screen_text(view)[-1].split()[0] == str(n) and view.following,
            what="back at the end",
        )
        await pilot.press("slash", *"step 2500000 ", "enter")
        await until(pilot, lambda: view.found_line == 2_500_000, timeout=120, what="a search across the file")
        assert any("step 2500000 " in t for t in screen_text(view))
