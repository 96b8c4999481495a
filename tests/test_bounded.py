"""What the operator sees never freezes or blanks (issue 37, item 4): an event line of any size, a torn last line,
a state.json of 10,000 stages or a corrupt one, and ``aerie force`` on a stage that cannot start yet.

Real files, a real supervisor and its stages, the real ``aerie`` CLI and the console through Textual's Pilot; the
SSH transport's half of it (the remote agent's bounded answers) in ``tests/test_bounded_ssh.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from console.app import AerieApp
from console.model import READ_WINDOW, RunModel
from console.screens.dialogs import ConfirmScreen
from console.transport import LocalTransport
from console.widgets.board import StageBoard
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.events import MAX_EVENT_BYTES, EventTail, EventWriter, decode, make, read_all
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from pipeline.run.rundir.protocol import Message
from pipeline.run.rundir.stage_status import StageStatus
from tests.runs import ROOT, ctl, kill_run_stages, make_run, start_supervisor, stop, wait_for

PY = sys.executable
FIVE_MIB = 5 << 20


def raw_line(n: int = FIVE_MIB) -> bytes:
    """A valid event line of ``n`` bytes of text, as a command that bypasses the event writer could write."""
    return b'{"type":"message","t":1,"level":"info","text":"' + b"x" * n + b'"}\n'


def aerie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "console.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )


# ------------------------------------------------------------------------------------------ the writer
def test_an_event_of_any_size_is_written_capped_valid_and_marked(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("progress", done=1, total=3)
        w.emit(
            "message", level="error", text="Traceback:\n" + "é" * FIVE_MIB, detail={"argv": ["a" * 300_000]}
        )
        w.emit("metric", name="loss", value=0.5, samples=list(range(200_000)))
        w.emit("progress", done=2, total=3)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 4 and all(len(ln) <= MAX_EVENT_BYTES for ln in lines)
    evs = [decode(ln) for ln in lines]
    assert [e.type for e in evs] == ["progress", "message", "metric", "progress"]
    msg = evs[1]
    assert msg.get("level") == "error" and msg.get("text").startswith("Traceback:\né")
    assert "… [truncated " in msg.get("text") and msg.get("text").endswith(" bytes]")
    assert msg.get("truncated") > FIVE_MIB  # the original line's size, for anyone who wonders
    assert "… [truncated " in msg.get("detail")["argv"][0]  # nested strings are cut too
    metric = evs[2]
    assert metric.get("name") == "loss" and metric.get("value") == 0.5  # what its type needs stays
    assert str(metric.get("samples")).startswith("[dropped: ")
    assert evs[3].get("done") == 2


# ------------------------------------------------------------------------------------------ torn lines
def test_a_torn_last_line_never_swallows_the_next_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("progress", done=1, total=3)
    with open(path, "ab") as fh:  # a writer killed mid-line
        fh.write(b'{"type":"progress","t":2,"do')
    with EventWriter(path) as w:  # the next writer (a retry's launcher, the stage) ends the torn line first
        w.emit("progress", done=2, total=3)
    chunk = EventTail(path).read()
    assert [e.get("done") for e in chunk.events] == [1, 2]
    assert chunk.bad_lines == ['{"type":"progress","t":2,"do']  # the fragment: one bad line of its own

    # A fragment glued to an event by a writer that did not end it (not ours): the event is salvaged.
    with open(path, "ab") as fh:
        fh.write(b'{"type":"metr{"type":"progress","t":3,"done":3,"total":3}\n')
    chunk = EventTail(path, offset=chunk.offset).read()
    assert [e.get("done") for e in chunk.events] == [3] and len(chunk.bad_lines) == 1


# ------------------------------------------------------------------------------------------ over-long lines
@pytest.mark.parametrize("window", [4 << 20, 64 << 10])
def test_a_line_longer_than_the_readers_window_is_skipped_with_a_warning(tmp_path: Path, window: int) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("progress", done=1, total=3)
    with open(path, "ab") as fh:
        fh.write(raw_line())
    with EventWriter(path) as w:
        w.emit("progress", done=2, total=3)
    tail = EventTail(path, max_bytes=window)
    done: list[int] = []
    notes: list[str] = []
    for _ in range(100):  # a bounded number of reads, each at most a window
        chunk = tail.read()
        done += [e.get("done") for e in chunk.events]
        notes += chunk.bad_lines
        if tail.offset == path.stat().st_size:
            break
    assert done == [1, 2]
    assert len(notes) == 1 and f"skipped a line of {len(raw_line()):,} bytes" in notes[0]
    assert [e.get("done") for e in read_all(path) if e.type == "progress"] == [1, 2]


# ------------------------------------------------------------------------------------------ a real run
STAGE = """
import sys, time
from pathlib import Path
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
ctx.progress(1, 3, unit="steps", force=True)
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
with open(ctx.events_path, "ab") as fh:  # bypassing the event writer: one 5 MiB line
    fh.write(b'{"type":"message","t":1,"level":"info","text":"' + b"x" * (5 << 20) + b'"}\\n')
ctx.progress(2, 3, unit="steps", force=True)
ctx.progress(3, 3, unit="steps", force=True)
ctx.message("after the long line")
"""


async def test_a_5mib_event_line_freezes_neither_state_nor_status_nor_the_console(tmp_path: Path) -> None:
    (tmp_path / "stage.py").write_text(STAGE)
    go = tmp_path / "go"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "big"
        command = "{PY} {tmp_path / "stage.py"} {go}"
        """,
    )
    sup = start_supervisor(run)
    try:
        model = RunModel(LocalTransport(str(run.root)))

        async def poll_until(pred, what: str) -> None:  # noqa: ANN001
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await model.poll()
                if pred():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"timed out waiting for {what}")

        await poll_until(
            lambda: "big" in model.stages and model.stages["big"].progress.done == 1, "progress 1"
        )
        go.touch()  # the console is attached and reading when the 5 MiB line lands
        texts = lambda: [getattr(e, "text", None) for e in model.stages["big"].events]  # noqa: E731
        await poll_until(
            lambda: "after the long line" in texts(), "the event after the long line, in the console"
        )
        # the row's progress is the supervisor's snapshot (it read past the long line too)
        await poll_until(lambda: model.stages["big"].progress.done == 3, "progress 3 in the snapshot")
        notes = [
            e.text for e in model.stages["big"].events if isinstance(e, Message) and e.code == "skipped-line"
        ]
        assert len(notes) == 1 and f"{READ_WINDOW:,}-byte window" in notes[0]

        def state_progress() -> object:
            rows = (read_json(run.state_path) or {}).get("stages", [])
            return next((r.get("progress") or {} for r in rows if r["id"] == "big"), {}).get("done")

        wait_for(lambda: state_progress() == 3, timeout=30, what="progress 3 in state.json")
        res = aerie("status", str(run.root))
        assert res.returncode == 0 and "3/3 steps" in res.stdout, res.stdout + res.stderr
        assert "skipped a line of" in (run.root / "supervisor.log").read_text()
    finally:
        stop(sup)
        kill_run_stages(run)


BACKLOG_STAGE = """
import json, os, sys
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
ctx.progress(1, {n}, unit="steps", force=True)
lines = b"".join(
    json.dumps({{"type": "progress", "t": 1.0, "done": i, "total": {n}, "unit": "steps"}}).encode() + b"\\n"
    for i in range(2, {n} + 1)
)
fd = os.open(ctx.events_path, os.O_WRONLY | os.O_APPEND)
while lines:  # more than a reader's window of events, written in a burst just before the stage exits
    lines = lines[os.write(fd, lines):]
"""


def test_a_stage_that_ends_right_after_a_burst_of_events_is_shown_with_its_last_one(tmp_path: Path) -> None:
    """The supervisor read the events, then saw the stage end (the same tick): what the stage wrote in between,
    more than one read window of it, must still reach the snapshot the finished run's supervisor exits on."""
    n = 120_000  # ~7 MiB of progress events: more than the supervisor's 4 MiB read window
    (tmp_path / "stage.py").write_text(BACKLOG_STAGE.format(n=n))
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "burst"
        command = "{PY} {tmp_path / "stage.py"}"
        """,
    )
    sup = start_supervisor(run)
    try:
        assert sup.wait(timeout=120) == 0  # every stage finished: the supervisor exited by itself
        row = next(r for r in read_json(run.state_path)["stages"] if r["id"] == "burst")
        assert row["state"] == "succeeded"
        assert (row["progress"] or {}).get("done") == n, row["progress"]
    finally:
        stop(sup)
        kill_run_stages(run)


# ------------------------------------------------------------------------------------------ 10,000 stages
N_BIG = 10_000


def big_run(tmp: Path, n: int = N_BIG) -> RunDir:
    """A run directory of a real plan of ``n`` trivial stages (loaded and checked as ``aerie plan check`` does)
    with the state.json its supervisor would write: creating the run's 10,000 stage directories takes
    ~10 s, so the snapshot is built from the plan's own specs instead."""
    body = '[run]\nname = "big"\ndir = "run"\n[resources]\ncpu_slots = 4\n' + "".join(
        f'[[stage]]\nid = "s{i:05d}"\ncommand = "true"\n' + (f'after = ["s{i - 1:05d}"]\n' if i % 2 else "")
        for i in range(n)
    )
    (tmp / "plan.toml").write_text(body)
    plan = plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run")
    root = tmp / "run"
    (root / "stages").mkdir(parents=True)
    (root / "plan.toml").write_text(body)
    rows = []
    for i, spec in enumerate(plan.stages):
        st = StageStatus(id=spec.id, family=spec.family, after=list(spec.after), run=spec.run)
        if i % 3 == 0:
            st.state, st.started_at, st.pid, st.pgid = "running", 1.0, 4_000_000, 4_000_000  # type: ignore[assignment]
            st.progress = {"done": i, "total": N_BIG, "unit": "rows", "t": 2.0}
        elif spec.after:
            st.reason = f"after {spec.after[0]}"
        rows.append(asdict(st))
    write_json(root / "state.json", {"run": "big", "executor": "local", "stages": rows, "done": False})
    write_json(root / "order.json", [s.id for s in plan.stages])
    return RunDir(root)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return big_run(tmp_path_factory.mktemp("big"))


async def test_the_console_model_reads_a_state_of_10000_stages(big: RunDir) -> None:
    assert big.state_path.stat().st_size > 4 * READ_WINDOW  # far over one read's window
    model = RunModel(LocalTransport(str(big.root)), backfill=False)
    await model.poll()
    assert model.error is None
    assert len(model.order) == N_BIG and model.order[-1] == f"s{N_BIG - 1:05d}"
    assert model.stages["s09999"].state == "running" and model.stages["s09999"].progress.done == 9999
    assert model.stages["s00001"].reason == "after s00000"


async def test_the_board_shows_10000_stages(big: RunDir) -> None:
    app = AerieApp(LocalTransport(str(big.root)), poll_s=0.5, alerts=False, read_only=True)
    async with app.run_test(size=(140, 40)) as pilot:
        board = app.query_one(StageBoard)
        deadline = time.monotonic() + 60
        while board.row_count < N_BIG and time.monotonic() < deadline:
            await pilot.pause(0.2)
        assert board.row_count == N_BIG
        assert str(board.get_row("s09999")[1]) == "running"


@pytest.mark.slow
def test_aerie_status_prints_10000_stages(big: RunDir) -> None:
    """Every stage's row, and every other line a line: long lists of stage ids and the per-stage estimates
    and anomalies are summarised ("… and 6,659 more"); --json stays complete."""
    t0 = time.monotonic()
    res = aerie("status", str(big.root))
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"s\d{5} ", ln)]  # not "supervisor: …"
    assert len(rows) == N_BIG and rows[-1].split()[:2] == ["s09999", "running"]
    others = [ln for ln in res.stdout.splitlines() if not re.match(r"s\d{5} ", ln)]
    assert max(len(ln) for ln in others) < 400, max(others, key=len)[:200]
    assert len(others) < 200, len(others)
    assert (
        "… and 6,659 more" in res.stdout and "more estimates (aerie status --json has them all)" in res.stdout
    )
    print(f"aerie status of {N_BIG:,} stages: {took:.1f}s")  # the limit: 5 s on a loaded 2-core CI
    res = aerie("status", str(big.root), "--json")
    assert res.returncode == 0
    ids = [json.loads(ln).get("id") for ln in res.stdout.splitlines()]
    assert sum(1 for i in ids if i) == N_BIG


@pytest.mark.slow
def test_aerie_status_into_a_closed_pipe_exits_quietly(big: RunDir) -> None:
    """`aerie status RUN | head -1`: the first row, then a quiet exit (the SIGPIPE convention), never a
    BrokenPipeError traceback or an error line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(3):
        res = subprocess.run(
            [
                "bash",
                "-c",
                f'"{PY}" -m console.cli status "{big.root}" | head -1; echo "rc=${{PIPESTATUS[0]}}"',
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert res.stdout.splitlines()[0].startswith("s00000 ")
        assert res.stdout.splitlines()[-1] == "rc=141" and res.stderr == "", res.stderr


def test_a_long_list_of_pids_is_summarised() -> None:
    """A kill answer names its processes, however many, in one short line."""
    from pipeline.run.hosts.procs import describe_pids

    assert describe_pids([5, 3]) == "pids 3, 5"
    text = describe_pids(list(range(1000, 1396)))
    assert text.startswith("pids 1000, 1001") and text.endswith("… and 388 more") and len(text) < 80


# ------------------------------------------------------------------------------------------ corrupt state.json
def test_a_truncated_state_json_is_one_line_never_a_traceback(tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        """
        [run]
        dir = "run"
        [[stage]]
        id = "a"
        command = "true"
        [[stage]]
        id = "b"
        command = "true"
        after = ["a"]
        """,
    )
    sd = run.stage("a")
    write_json(sd.exit, {"attempt": 1, "returncode": 0, "t": 1.0})
    good = json.dumps({"stages": [{"id": "a", "state": "succeeded"}]})
    run.state_path.write_text(good[: len(good) // 2])  # torn mid-write

    res = aerie("status", str(run.root))
    assert res.returncode == 0 and "Traceback" not in res.stderr
    problem = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(problem) == 1 and f"{run.state_path} is truncated or not valid JSON" in problem[0]
    assert "showing stages from their own files" in problem[0] and "next snapshot" in problem[0]
    rows = {ln.split()[0]: ln.split()[1] for ln in res.stdout.splitlines() if ln[:2] in ("a ", "b ")}
    assert rows == {"a": "succeeded", "b": "waiting"}

    res = aerie("status", str(run.root), "--json")
    first = json.loads(res.stdout.splitlines()[0])
    assert res.returncode == 0 and "is truncated or not valid JSON" in first["error"]

    res = ctl(run, "status")
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert "is truncated or not valid JSON" in json.loads(res.stdout)["error"]


async def test_the_console_says_state_json_is_corrupt_instead_of_a_blank_board(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "stages").mkdir(parents=True)
    (root / "state.json").write_text('{"stages": [{"id": "a", "sta')
    app = AerieApp(LocalTransport(str(root)), poll_s=0.2, alerts=False, read_only=True)
    async with app.run_test(size=(140, 36)) as pilot:
        await pilot.pause(0.5)
        line = str(app.query_one("#status-line").render())
        assert "state.json is truncated or not valid JSON" in line and "next snapshot" in line
        # The supervisor's next snapshot heals it.
        write_json(
            root / "state.json", {"run": "r", "stages": [{"id": "a", "family": "a", "state": "pending"}]}
        )
        deadline = time.monotonic() + 20
        while app.query_one(StageBoard).row_count != 1 and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert app.query_one(StageBoard).row_count == 1
        assert "not valid JSON" not in str(app.query_one("#status-line").render())


# ------------------------------------------------------------------------------------------ force
def test_force_on_a_waiting_stage_says_what_it_will_do_and_when(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "extract"
        command = "while [ ! -e {gate} ]; do sleep 0.05; done"
        [[stage]]
        id = "prep"
        command = "true"
        after = ["extract"]
        """,
    )
    sup = start_supervisor(run)
    try:
        wait_for(
            lambda: (
                {s["id"]: s["state"] for s in (read_json(run.state_path) or {}).get("stages", [])}.get(
                    "extract"
                )
                == "running"
            ),
            what="extract running",
        )
        res = ctl(run, "force", "prep")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == (
            "prep is waiting for extract (running): --force is armed for attempt 1; when its dependencies "
            "finish it will start without the disk-budget and GPU-guard checks"
        )
        gate.touch()
        wait_for(
            lambda: any(e.get("code") == "forced" for e in read_all(run.stage("prep").events)),
            what="the forced start recorded in prep's events",
        )
        forced = next(e for e in read_all(run.stage("prep").events) if e.get("code") == "forced")
        assert forced.get("level") == "warning" and forced.get("attempt") == 1
    finally:
        stop(sup)
        kill_run_stages(run)


async def test_the_console_asks_before_forcing_and_alerts_when_the_forced_stage_starts(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "extract"
        command = "while [ ! -e {gate} ]; do sleep 0.05; done"
        [[stage]]
        id = "prep"
        command = "sleep 30"
        after = ["extract"]
        kill_grace_s = 1
        """,
    )
    sup = start_supervisor(run)
    try:
        app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2)
        async with app.run_test(size=(140, 36)) as pilot:

            async def until(pred, what: str) -> None:  # noqa: ANN001
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if pred():
                        return
                    await pilot.pause(0.1)
                raise AssertionError(f"timed out waiting for {what}")

            stages = app.model.stages
            await until(
                lambda: "extract" in stages and stages["extract"].state == "running", "extract running"
            )
            board = app.query_one(StageBoard)
            await pilot.press("down")
            assert board.selected_key == "prep"
            await pilot.press("F")
            await until(lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            question = app.screen.question  # type: ignore[attr-defined]
            assert "Force prep?" in question and "waiting for extract (running)" in question
            assert "--force will be armed" in question and "without the disk-budget and GPU-guard" in question
            await pilot.press("n")
            await pilot.pause(0.5)
            assert not run.stage("prep").force_marker.exists(), "saying no arms nothing"

            await pilot.press("F")
            await until(lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            await pilot.press("y")
            await until(lambda: run.stage("prep").force_marker.exists(), "force armed")
            gate.touch()
            await until(lambda: app.alerts.last_stage == "prep", "the forced-start alert")
            # The alert comes from the stage's events and the state from state.json: two reads, so the
            # board may show the start a poll after the alert.
            await until(lambda: stages["prep"].state == "running", "the board to show prep running")
    finally:
        stop(sup)
        kill_run_stages(run)


def test_the_force_question_is_built_from_the_rows_dependencies_never_from_the_reasons_words() -> None:
    """Which dependencies prep still waits for is read from its row's ``after`` and their states in the
    snapshot; its ``reason`` is quoted only once none is left (then it is what else holds it)."""
    from console.app import force_plan
    from console.model import StageView

    extract = StageView(id="extract", family="extract", state="running")
    lint = StageView(id="lint", family="lint", state="skipped")
    # Words the console must not read: a dependency-waiting reason phrased otherwise than "after …".
    prep = StageView(id="prep", family="prep", after=["extract", "lint", "gone"], reason="held until extract")
    stages = {s.id: s for s in (extract, lint, prep)}
    question = force_plan(prep, stages)
    assert "prep is waiting for extract (running), gone (unknown)" in question, question
    assert "held until" not in question and "when its dependencies finish" in question
    extract.state, prep.after = "succeeded", ["extract", "lint"]
    prep.reason = "waiting for GPUs 0,1 (held by train)"
    question = force_plan(prep, stages)
    assert question.startswith("prep is waiting for GPUs 0,1 (held by train): --force will be armed"), (
        question
    )
    assert "when they are free" in question
    prep.reason = "disk budget: 12 GiB needed, 3 GiB free"
    assert "(held by: disk budget: 12 GiB needed, 3 GiB free)" in force_plan(prep, stages)


async def test_an_armed_force_is_shown_everywhere_and_disarmed_by_a_key_or_the_cli(tmp_path: Path) -> None:
    """Armed on a waiting stage, ``force`` is marked on the board (⚑), said in the detail pane and by ``aerie
    status``; F on the stage disarms it, ``aerie force --cancel`` too, and both land in the audit log."""
    gate = tmp_path / "gate"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "extract"
        command = "while [ ! -e {gate} ]; do sleep 0.05; done"
        [[stage]]
        id = "prep"
        command = "true"
        after = ["extract"]
        """,
    )
    sup = start_supervisor(run)

    def row(sid: str) -> dict:
        rows = (read_json(run.state_path) or {}).get("stages", [])
        return next((s for s in rows if s["id"] == sid), {"state": "none yet"})

    try:
        wait_for(lambda: row("extract")["state"] == "running", what="extract running")
        assert aerie("force", "--cancel", str(run.root), "prep").returncode == 3, "nothing armed: refused"
        assert ctl(run, "force", "prep").returncode == 0
        wait_for(lambda: row("prep").get("forced") is True, what="state.json marking prep forced")
        status = aerie("status", str(run.root))
        prep_line = next((ln for ln in status.stdout.splitlines() if ln.startswith("prep ")), status.stdout)
        assert "⚑ force armed" in prep_line and "force --cancel" in prep_line, status.stdout
        app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False)
        async with app.run_test(size=(140, 36)) as pilot:
            board = app.query_one(StageBoard)
            deadline = time.monotonic() + 20
            while not (app.model.stages.get("prep") and app.model.stages["prep"].forced):
                assert time.monotonic() < deadline, "the console never saw the armed force"
                await pilot.pause(0.1)
            board.select_key("prep")
            await pilot.pause(0.3)
            assert "⚑ force armed" in _board_text(board)
            facts = str(app.query_one("#facts").render())
            assert "--force armed for attempt 1" in facts and "F again disarms it" in facts
            await pilot.press("F")  # armed: F disarms, no question
            deadline = time.monotonic() + 20
            while run.stage("prep").force_marker.exists() or app.model.stages["prep"].forced:
                assert time.monotonic() < deadline, "F did not disarm the force"
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            assert "⚑" not in _board_text(board)
        assert ctl(run, "force", "prep").returncode == 0
        res = aerie("force", "--cancel", str(run.root), "prep")
        assert res.returncode == 0 and "--force disarmed for attempt 1" in res.stdout, res.stderr
        audit_lines = [json.loads(ln) for ln in (run.root / "audit.jsonl").read_text().splitlines()]
        outcomes = [(a["action"], a["via"], a["outcome"]) for a in audit_lines if a["stage"] == "prep"]
        assert outcomes == [
            ("unforce", "cli", "refused"),
            ("force", "ctl", "done"),
            ("unforce", "console", "done"),
            ("force", "ctl", "done"),
            ("unforce", "cli", "done"),
        ]
        gate.touch()
        wait_for(lambda: row("prep")["state"] == "succeeded", what="prep done")
        assert not any(e.get("code") == "forced" for e in read_all(run.stage("prep").events)), (
            "disarmed: unforced"
        )
    finally:
        stop(sup)
        kill_run_stages(run)


def _board_text(board: StageBoard) -> str:
    return "\n".join(" ".join(str(c) for c in r.cells) for r in board._rows)


async def test_the_curves_read_back_past_an_over_long_line_in_the_skipped_head(tmp_path: Path) -> None:
    """Attaching reads the last 256 KiB of an events file; the curves then read its head back 2 MiB at a time.
    A 5 MiB line in that head is skipped, not waited on: the curve still starts at step 0."""
    from console.model import StageView

    sd = tmp_path / "stages" / "train"
    sd.mkdir(parents=True)
    path = sd / "events.jsonl"
    with EventWriter(path) as w:
        w.write(make("started", t=1000.0, attempt=1, pid=1))
        for step in range(100):
            w.write(make("metric", t=1000.0 + step, name="loss", value=5.0 - step / 100, step=step))
    with open(path, "ab") as fh:
        fh.write(raw_line())
    with EventWriter(path) as w:
        for step in range(100, 6000):
            w.write(make("metric", t=1000.0 + step, name="loss", value=4.0 - step / 10_000, step=step))
    model = RunModel(LocalTransport(str(tmp_path)))
    model.stages["train"] = StageView(id="train", family="train")
    model.order = ["train"]
    for _ in range(12):
        await model.poll()
    loss = model.stages["train"].history.get("loss")
    assert loss.xs[0] < 10 and loss.xs[-1] > 5990
    # Steps 100..~2800 lie between the long line and the attach tail: read back past the line, not dropped.
    assert any(1000 < x < 2000 for x in loss.xs)
