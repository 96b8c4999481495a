"""Operator experience around the board: themes, settings, the dataset panel, help,
the command palette and browser mode — on real runs through the real console (Pilot) and processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from console.app import AerieApp
from console.cli import main as cli_main
from console.datasets import dataset_rows
from console.model import Progress, RunModel, StageView
from console.screens.audit import AuditScreen
from console.screens.datasets import DatasetsScreen
from console.screens.dialogs import HelpScreen
from console.screens.logview import LogScreen
from console.screens.metrics import MetricsScreen
from console.settings import resolve
from console.transport import LocalTransport
from console.widgets.logview import LogView
from tests.runs import ROOT, finished_run
from tests.test_console import until
from themes import STATES, ThemeError, load_themes, parse_theme

THEMES = list(load_themes())


# ------------------------------------------------------------------------------ themes
@pytest.mark.parametrize("theme", THEMES)
def test_theme_snapshot(snap_compare, theme: str) -> None:  # noqa: ANN001
    run = finished_run(Path(f"/tmp/aerie-theme-{theme}"))
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, theme=theme, alerts=False, user_config={})

    async def loaded(pilot) -> None:  # noqa: ANN001
        await until(pilot, lambda: app.model.loaded and app.model.done, what="the finished run")
        # Attaching selected the latest failure (the killed prep.codefeedback) and its detail shows it.
        await until(pilot, lambda: app.query_one("#detail").stage_id == "prep.codefeedback", what="selection")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(150, 34), run_before=loaded)


def test_bundled_themes_colour_every_state_and_bad_files_name_the_key() -> None:
    assert THEMES[0] == "aerie-dark" and {"aerie-light", "aerie-contrast"} <= set(THEMES)
    for theme in load_themes().values():
        assert all(f"state-{s}" in theme.variables for s in STATES)
    contrast = load_themes()["aerie-contrast"].variables
    assert contrast["state-failed"] != contrast["state-succeeded"] != contrast["state-running"]
    good = {
        "theme": {"name": "x", "primary": "#123456"},
        "variables": {f"state-{s}": "#ffffff" for s in STATES},
    }
    assert parse_theme(good, "x.toml").name == "x"
    bad_var = {**good, "variables": {k: v for k, v in good["variables"].items() if k != "state-paused"}}
    with pytest.raises(
        ThemeError, match=r"x.toml: variables.state-paused: every Aerie theme colours every state"
    ):
        parse_theme(bad_var, "x.toml")
    with pytest.raises(ThemeError, match=r"x.toml: theme.primary: 'nope' is not a colour"):
        parse_theme({**good, "theme": {"name": "x", "primary": "nope"}}, "x.toml")
    with pytest.raises(ThemeError, match=r"x.toml: theme.shade: unknown key"):
        parse_theme({**good, "theme": {"name": "x", "primary": "#000", "shade": 1}}, "x.toml")


async def test_state_colours_follow_the_theme_and_the_palette_switches_it(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        assert app.theme == "aerie-dark"
        for name, theme in load_themes().items():
            app.action_set_theme(name)
            await pilot.pause(0.1)
            assert app.state_style("failed").lower() == "bold " + theme.variables["state-failed"].lower()
            assert app.state_style("running").lower() == theme.variables["state-running"].lower()
        app.action_set_theme("aerie-dark")
        await pilot.press("ctrl+p")
        await pilot.pause(0.3)
        await pilot.press(*"Theme: aerie-light")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await until(pilot, lambda: app.theme == "aerie-light", what="the palette's theme command")


def test_settings_precedence_and_problems_name_file_and_key() -> None:
    known = THEMES
    user = {"ui": {"theme": "aerie-contrast"}, "alerts": {"bell": False, "command": "notify-send x"}}
    plan = {"ui": {"theme": "aerie-light"}, "alerts": {"command": "curl -d x hook", "timeout_s": 5}}
    s = resolve(None, user, "~/.config/aerie/config.toml", plan, "RUN/plan.toml", known)
    assert (s.theme, s.theme_from) == ("aerie-contrast", "~/.config/aerie/config.toml")
    assert s.bell is False and s.hooks == ["curl -d x hook", "notify-send x"] and s.hook_timeout_s == 5
    assert resolve(None, {}, "u", plan, "p", known).theme == "aerie-light"
    assert resolve("aerie-dark", user, "u", plan, "p", known).theme == "aerie-dark"
    assert resolve(None, {}, "u", {}, "p", known).theme == "aerie-dark"
    bad = resolve(
        None, {"ui": {"theme": "neon"}, "alerts": {"bel": True, "bell": "yes"}}, "cfg.toml", {}, "p", known
    )
    assert bad.theme == "aerie-dark" and bad.bell is True
    assert any(
        p.startswith("cfg.toml: ui.theme: unknown theme 'neon' (known: aerie-dark") for p in bad.problems
    )
    assert any(
        p.startswith(
            "cfg.toml: alerts.bel: unknown key (known: command, bell, notify, timeout_s, stall_minutes"
        )
        for p in bad.problems
    )
    assert "cfg.toml: alerts.bell: expected true or false, got 'yes'" in bad.problems


def test_cli_refuses_an_unknown_theme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = finished_run(tmp_path / "r")
    assert cli_main(["attach", str(run.root), "--theme", "neon"]) == 2
    assert "--theme neon: unknown theme (known: aerie-dark" in capsys.readouterr().err


# ------------------------------------------------------------------------------ datasets
def stage(sid: str, state: str, done: float, total: float, rate: float | None, rejects: int = 0) -> StageView:
    st = StageView(id=sid, family=sid.split(".")[0], dataset=sid.split(".")[1], state=state, rejects=rejects)
    st.progress = Progress()
    if rate:
        st.progress.add(100.0, done - rate * 10, total, "rows")
    st.progress.add(110.0, done, total, "rows")
    return st


def test_dataset_rows_sorted_by_state_then_eta() -> None:
    model = RunModel(LocalTransport("/nonexistent"))
    for st in [
        stage("prep.a", "succeeded", 100, 100, None),
        stage("prep.b", "running", 10, 100, 1.0),
        stage("prep.c", "running", 90, 100, 1.0),
        stage("prep.d", "failed", 40, 100, None, rejects=9),
        stage("regen.c", "pending", 0, 50, None),
        stage("prep.e", "paused", 5, 100, None),
    ]:
        model.stages[st.id] = st
        model.order.append(st.id)
    model.stages["train"] = StageView(id="train", family="train")
    model.order.append("train")
    rows = dataset_rows(model)
    assert [r.stage for r in rows] == ["prep.d", "prep.c", "prep.b", "prep.e", "regen.c", "prep.a"]
    c = rows[1]
    assert (c.done, c.total, round(c.rate or 0, 3), round(c.eta_s or 0)) == (90, 100, 1.0, 10)
    assert rows[0].rejects == 9


async def test_dataset_screen_lists_the_preps_and_opens_a_log(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded and app.model.done, what="loaded")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, DatasetsScreen), what="the dataset screen")
        from textual.widgets import DataTable

        table = app.screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count == 10, what="10 preps")
        first = [str(c) for c in table.get_row_at(0)]
        assert first[:3] == ["sharegpt", "prep", "failed"] and "1,000 rows" in first[3]
        assert [str(table.get_row_at(i)[2]) for i in range(10)][2:] == ["succeeded"] * 8
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LogScreen), what="its log")
        assert app.screen.index.path == "stages/prep.sharegpt/stage.log"
        await pilot.press("escape", "escape")
        await until(pilot, lambda: not isinstance(app.screen, (LogScreen, DatasetsScreen)), what="the board")


# ------------------------------------------------------------------------------ help and palette
NOT_COMMANDS = {"clear_filter", "back", "help", "read_only"}  # Esc, ?, a read-only console's refusals


async def test_help_lists_every_key_and_the_palette_every_action(tmp_path: Path) -> None:
    from console.screens.dialogs import key_label

    run = finished_run(tmp_path / "r")
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        for key, extra in (
            (None, ()),
            ("d", (DatasetsScreen,)),
            ("l", (LogScreen, LogView)),
            ("m", (MetricsScreen,)),
            ("A", (AuditScreen,)),
        ):
            if key == "l":
                await pilot.press("down")  # a stage, not the family row
            if key:
                await pilot.press(key)
                await until(
                    pilot, lambda extra=extra: isinstance(app.screen, extra[0]), what=f"the {key} screen"
                )
            screen = app.screen
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
            help_text = app.screen.text
            labels = {line.split("  ")[0] for line in help_text.splitlines()}
            shown = {k for label in labels for k in label.split(" / ")}
            groups = [line for line in help_text.splitlines() if line.startswith("[")]
            assert groups[:1] == ["[Navigate]"] and "[Views]" in groups, groups
            if key not in ("d", "A"):
                assert "[Control the selected stage]" in groups
            for internal in ("cursor", "(-", "Scroll Left", "Page Left", "Focus Next", "k_up", "pgup", "^p"):
                assert internal not in help_text, f"{internal!r} is framework talk, in the help of {screen}"
            await pilot.press("escape")
            for src in (AerieApp, *extra):
                for b in src.BINDINGS:
                    for k in b.key.split(","):
                        label = key_label(app, k.strip())
                        assert label in shown, (
                            f"{k!r} ({label}) is not in the help of {type(screen).__name__}"
                        )
            callbacks = [c.callback for c in app.get_system_commands(screen)]
            for src, target in ((AerieApp, app), *((cls, screen) for cls in extra[:1])):
                for b in src.BINDINGS:
                    action = b.action.split("(")[0]
                    if action not in NOT_COMMANDS:
                        assert getattr(target, f"action_{action}") in callbacks, (
                            f"no palette command for {action} on {type(screen).__name__}"
                        )
            while isinstance(app.screen, (LogScreen, DatasetsScreen, MetricsScreen, AuditScreen)):
                app.screen.dismiss(None)
                await pilot.pause(0.2)


# ------------------------------------------------------------------------------ browser mode
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_browser_mode_serves_the_console_on_loopback(tmp_path: Path) -> None:
    import aiohttp

    run = finished_run(tmp_path / "r")
    assert cli_main(["serve", str(run.root), "--host", "0.0.0.0"]) == 2  # never on a network interface
    port = free_port()
    token = "t0ken-of-the-browser-test"
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp_path / "none.toml"), AERIE_SERVE_TOKEN=token
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "serve", str(run.root), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        bearer = {"Authorization": f"Bearer {token}"}  # a token is required on loopback too
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/", headers=bearer) as resp:
                        page = await resp.text()
                        break
                except aiohttp.ClientConnectionError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    await asyncio.sleep(0.3)
            assert resp.status == 200 and "/ws" in page
            screen = ""
            async with http.ws_connect(
                f"http://127.0.0.1:{port}/ws?width=120&height=36", headers=bearer
            ) as ws:
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not (
                    "prep.sharegpt" in screen and "snapshot" in screen
                ):
                    try:
                        msg = await ws.receive(timeout=5)
                    except TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        screen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", msg.data.decode(errors="replace"))
                    elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break
            assert "prep.sharegpt" in screen and "snapshot" in screen, screen[-2000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server we started, in its own session
        server.wait(20)
