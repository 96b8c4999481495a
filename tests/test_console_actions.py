"""The console's action table (``console/actions.py``) is the one source of every action's key, words and
refusal: each action is in the app's bindings, the help sheet and the command palette as the table says, a
read-only console refuses each control action (key or palette) with the table's words and sends nothing,
the ``aerie`` CLI offers the table's verbs and flags, and no other console module spells an action's words."""

from __future__ import annotations

from pathlib import Path

from console.actions import ACTIONS, CONTROLS, CTL_FLAGS, CTL_VERBS, READ_ONLY_NOTE, refusal
from console.app import AerieApp
from console.cli import build_parser
from console.screens.dialogs import HelpScreen, key_label
from console.widgets.board import StageBoard
from tests.runs import ROOT, finished_run
from tests.test_audit import Recording, settled
from tests.test_console import until


def test_every_action_has_a_way_in_and_a_method() -> None:
    names = [a.name for a in ACTIONS]
    assert len(names) == len(set(names)), "an action is in the table twice"
    keys = [a.key for a in ACTIONS if a.key]
    assert len(keys) == len(set(keys)), "two actions share a key"
    for a in ACTIONS:
        assert a.key or a.palette, f"{a.name}: neither a key nor a palette entry"
        assert callable(getattr(AerieApp, f"action_{a.name}", None)), (
            f"{a.name}: the app has no action_{a.name}"
        )
        assert not a.key or a.help, f"{a.name}: a key without a help line"
    assert {a.name for a in CONTROLS} == {
        "pause",
        "kill",
        "retry",
        "retry_fresh",
        "skip",
        "force",
        "unforce",
        "ack_alert",  # an alert of the run (issue 44): a control action too, audited
        "silence_alert",
    }


async def test_bindings_help_and_palette_are_the_table(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    app = AerieApp(Recording(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        live = {key: b.binding for key, b in app.screen.active_bindings.items()}
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        assert isinstance(app.screen, HelpScreen)
        help_rows = {line for line in app.screen.text.splitlines()}
        help_text = app.screen.text
        await pilot.press("escape")
    for a in ACTIONS:
        if a.key:
            b = live.get(a.key)
            assert b is not None and b.action == a.name, f"{a.key}: bound to {b and b.action}, not {a.name}"
            assert (b.description, b.tooltip, b.show) == (a.label, a.help, a.show), a.name
            assert f"{key_label(app, a.key)}  {a.help}" in help_rows, f"{a.name} is not in the help sheet"
        if a.palette:
            cmd = commands.get(a.palette)
            assert cmd is not None, f"{a.name}: no palette entry {a.palette!r}"
            assert cmd.help == a.palette_help and cmd.callback == getattr(app, f"action_{a.name}"), a.name
    control = help_text.split("[Control the selected stage]\n")[1].split("\n[")[0]
    assert [row.split("  ")[0] for row in control.splitlines()] == [str(a.key) for a in CONTROLS if a.key]
    assert READ_ONLY_NOTE not in help_text, "a console with control lists no refusal"


async def test_a_read_only_console_refuses_each_control_action_with_the_tables_words(tmp_path: Path) -> None:
    run = settled(tmp_path / "r")
    transport = Recording(str(run.root))
    app = AerieApp(transport, poll_s=0.2, alerts=False, user_config={}, read_only=True)
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: app.model.loaded, what="loaded")
        await pilot.press("home", "down")
        st = app.query_one(StageBoard).selected_stage(app.model)
        assert st is not None
        commands = {c.title: c.callback for c in app.get_system_commands(app.screen)}
        for a in CONTROLS:
            ways = (("key", lambda a=a: pilot.press(str(a.key))), ("palette", commands[a.palette]))
            for how, act in ways if a.key else ways[1:]:  # unforce: the palette (F again on a forced stage)
                app.clear_notifications()
                res = act()
                if res is not None:
                    await res
                await pilot.pause(0.1)
                said = [(n.message, n.title) for n in app._notifications]
                assert said == [(refusal(a.name, st.id), "read-only")], (a.name, how, said)
                assert app.screen is app.screen_stack[0], f"{a.name} ({how}): asked a question"
        help_keys = [
            b.binding for b in app.screen.active_bindings.values() if b.binding.tooltip == READ_ONLY_NOTE
        ]
        assert sorted(b.key for b in help_keys) == sorted(str(a.key) for a in CONTROLS if a.key)
    # It asks the host whether the supervisor lives (``ctl liveness``: a read that starts nothing), never more.
    assert transport.beyond_reads() == [], "a read-only console sends nothing"
    assert refusal("retry_fresh", "x").startswith(
        "read-only: this console only watches; retry --fresh x was not"
    )


def test_the_cli_control_verbs_are_the_tables() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    choices = getattr(sub, "choices", {})
    assert set(CTL_VERBS) == {"pause", "resume", "kill", "retry", "skip", "force", "ack", "silence"}
    for verb in CTL_VERBS:
        args = choices[verb].parse_args(["RUN", "STAGE", *(f for f, _ in CTL_FLAGS[verb])])
        assert args.action == verb
        for flag, _ in CTL_FLAGS[verb]:
            assert getattr(args, flag.lstrip("-").replace("-", "_")) is True
    assert CTL_FLAGS["retry"] == (("--fresh", "clear the stage's outputs (inside the run dir) first"),)
    assert [f for f, _ in CTL_FLAGS["force"]] == ["--cancel"]  # ``aerie force --cancel RUN STAGE`` disarms


def test_no_other_console_module_spells_an_actions_words() -> None:
    """The control actions' words and the refusal live in the table only; the app spells none of the table's.
    (A screen's own keys, such as the dataset screen's ``l``, are that screen's.)"""
    control = [w for a in CONTROLS for w in (a.help, a.palette, a.palette_help, a.confirm, a.wrong_state)]
    board = [w for a in ACTIONS for w in (a.help, a.palette_help) if len(w) > 20]
    for path in (ROOT / "console").rglob("*.py"):
        if path.name == "actions.py":
            continue
        text = path.read_text()
        for w in [*control, "this console only watches", *(board if path.name == "app.py" else [])]:
            assert not w or w not in text, (
                f"{path.relative_to(ROOT)} spells {w!r}: take it from console.actions"
            )
