"""Run files are private and bounded: everything a run creates is 0600/0700 even under ``umask 000``;
events, stage logs, the audit log and the supervisor's log rotate by size (small limits injected through
``AERIE_ROTATE_BYTES_*``), and every reader — the supervisor's, the console's event streams, its audit
view and its log viewer, ``aerie status`` — goes on across a rotation without losing or repeating an
entry, and without the stage's state going back."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from console.audit_trail import AuditTrail
from console.logindex import LogIndex
from console.model import RunModel
from console.transport import LocalTransport
from pipeline.run.rundir import audit, growth
from pipeline.run.rundir.events import CARRIED, Event, EventTail, EventWriter, read_all
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from pipeline.run.stage_side.launcher import attempt_tail, failure_line
from tests.runs import ctl, make_run, start_supervisor, stop, wait_done, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _retry_done(run: RunDir, attempt: int) -> bool:
    """Attempt ``attempt`` of stage ``bad`` has ended and the snapshot says the run is done with it."""
    state = read_json(run.state_path) or {}
    row = next((r for r in state.get("stages", []) if r.get("id") == "bad"), {})
    return bool(state.get("done")) and row.get("attempt") == attempt and row.get("state") == "failed"


def _done(events: list[Event]) -> list[object]:
    return [e.get("done") for e in events if e.type == "progress"]


# ------------------------------------------------------------------------------------- events
def test_event_readers_follow_rotation_with_two_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers (the launcher's and the stage's fds) take turns; one rotates under the other, whose
    next event must land in the new file. A reader polling between writes sees every event once, in
    order; a reader that starts after the rotations still knows the attempt and the latest progress."""
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "1500")
    path = tmp_path / "events.jsonl"
    launcher, stage = EventWriter(path), EventWriter(path)
    tail = EventTail(path)
    seen: list[Event] = []
    launcher.emit("started", attempt=2, pid=1)
    stage.emit("health", state="ready")
    stage.emit("message", level="info", code="paused", text="paused at a safe point")
    for i in range(300):
        (launcher if i % 3 == 0 else stage).emit("progress", done=i, total=300, unit="steps")
        if i % 5 == 0:
            stage.emit("metric", name="loss", value=1.0 / (i + 1), step=i)
        if i % 11 == 0:
            seen += tail.read().events
    seen += tail.read().events
    launcher.close()
    stage.close()

    assert _done(seen) == list(range(300))  # none lost, none twice, in order
    assert not any(e.get(CARRIED) for e in seen)
    assert [e.get("step") for e in seen if e.type == "metric"] == list(range(0, 300, 5))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["events.1.jsonl", "events.2.jsonl", "events.3.jsonl", "events.jsonl"]  # bounded
    assert all(p.stat().st_size < 1500 + 400 for p in tmp_path.iterdir())

    fresh = read_all(path)  # a new supervisor, a console attaching: the current generation only
    assert fresh[0].type == "started" and fresh[0].get("attempt") == 2 and fresh[0].get(CARRIED)
    assert _done(fresh)[-1] == 299
    latest = {e.type: e for e in fresh if e.get(CARRIED)}
    assert latest["health"].get("state") == "ready"
    assert latest["message"].get("code") == "paused"
    assert "metric" in latest and [e for e in fresh if e.type == "metric"][-1].get("step") == 295


def test_reader_far_behind_rotation_reads_current_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader whose generation was dropped (more rotations than are kept) starts the current file from
    its head: the carried lines give it the attempt and the latest progress, never an older state."""
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "600")
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("started", attempt=1, pid=1)
        tail = EventTail(path)
        first = tail.read().events
        for i in range(200):
            w.emit("progress", done=i, total=200)
    later = tail.read().events
    assert [e.type for e in first] == ["started"]
    assert later[0].type == "started" and later[0].get(CARRIED)
    assert _done(later)[-1] == 199 and _done(later) == sorted(_done(later))


def test_rotation_with_writers_in_other_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes append at the same time (rotating under each other) while this one reads."""
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "8000")
    path = tmp_path / "events.jsonl"
    code = (
        "import sys, time\nfrom pipeline.run.rundir.events import EventWriter\nw = EventWriter(sys.argv[1])\n"
        "for i in range(150):\n    w.emit('progress', done=i, key=sys.argv[2])\n    time.sleep(0.002)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), k], env=env) for k in "ab"]
    tail = EventTail(path)
    seen: list[Event] = []
    while any(p.poll() is None for p in procs):
        seen += tail.read().events
    seen += tail.read().events
    assert all(p.returncode == 0 for p in procs)
    assert (tmp_path / "events.1.jsonl").exists()
    for k in "ab":
        assert [e.get("done") for e in seen if e.get("key") == k] == list(range(150))


# ------------------------------------------------------------------------------------ console
def _state(run: Path, sid: str) -> None:
    write_json(run / "state.json", {"run": "r", "stages": [{"id": sid, "family": sid, "state": "running"}]})


def test_console_events_across_rotation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's per-stage stream (through the transport) finishes the old generation, then goes on
    in the new one without applying its carried copies again."""
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "1200")
    _state(tmp_path, "a")
    path = tmp_path / "stages" / "a" / "events.jsonl"
    model = RunModel(LocalTransport(str(tmp_path)), backfill=False)
    applied: list[Event] = []
    model.listeners.append(lambda st, ev: applied.append(ev))

    async def go() -> None:
        await model.poll()  # state.json: the stage appears
        with EventWriter(path) as w:
            w.emit("started", attempt=1, pid=1)
            for i in range(120):
                w.emit("progress", done=i, total=120)
                if i % 4 == 0:
                    await model.poll()
        for _ in range(8):  # the last generations, then the current file
            await model.poll()

    asyncio.run(go())
    assert (tmp_path / "stages" / "a" / "events.2.jsonl").exists()
    assert [e.type for e in applied].count("started") == 1
    assert _done(applied) == list(range(120))
    # the rate's samples come from the events (the row's progress is the supervisor's snapshot: none here)
    assert model.stages["a"].progress.samples[-1][1] == 119


def test_audit_rotation_cli_and_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """audit.jsonl rotates at its limit; ``aerie status``'s section and the console's audit view read the
    newest entries across the boundary, the view losing and repeating none."""
    monkeypatch.setenv("AERIE_ROTATE_BYTES_AUDIT", "900")
    trail = AuditTrail(LocalTransport(str(tmp_path)))

    async def go() -> None:
        for i in range(30):
            audit.append(tmp_path, audit.entry("kill", f"s{i}", "done", via="cli", who="ana@laptop"))
            if i % 4 == 0:
                await trail.poll()
        await trail.poll()

    asyncio.run(go())
    assert (tmp_path / "audit.1.jsonl").exists() and (tmp_path / "audit.4.jsonl").exists()
    assert not (tmp_path / "audit.5.jsonl").exists()
    assert [e.stage for e in trail.entries] == [f"s{i}" for i in range(30)]
    assert not trail.problems and trail.torn is None
    section = audit.status_section(tmp_path, n=10)
    assert [e["stage"] for e in section["entries"]] == [f"s{i}" for i in range(20, 30)]
    kept = sum(1 for p in tmp_path.glob("audit*.jsonl") for _ in p.open())
    assert section["total"] == kept
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.glob("audit*.jsonl"))


# ---------------------------------------------------------------------------------- stage log
def _log_writer(log: Path, limit: int) -> subprocess.Popen[bytes]:
    """A real stage log writer (the process the executor starts), reading a pipe we write."""
    env = {**os.environ, "AERIE_ROTATE_BYTES_LOG": str(limit), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.stage_side.log_writer", str(log)], stdin=subprocess.PIPE, env=env
    )


def test_the_failure_line_waits_for_a_writer_behind_and_ends_at_the_attempts_end_banner(
    tmp_path: Path,
) -> None:
    """The stage has exited but its log writer is behind (here stopped, as a writer held off the CPU after a
    burst is): the launcher's read waits until its end banner is in the log, so the reason is the stage's
    last words, not a line of the output before them; what a process the stage left running writes after
    the banner is not the reason either."""
    import signal
    import threading

    log = tmp_path / "stages" / "a" / "stage.log"
    log.parent.mkdir(parents=True)
    writer = _log_writer(log, 0)
    assert writer.stdin is not None
    banner = "===== aerie: a attempt 1 failed (rc 3) 2026-12-07 23:59:01 ====="
    try:
        writer.stdin.write(b"===== aerie: a attempt 1 started =====\n" + b"a line of output\n" * 5000)
        writer.stdin.flush()
        wait_for(lambda: log.exists() and log.stat().st_size > 80_000, 20, "the output written")
        os.kill(writer.pid, signal.SIGSTOP)
        writer.stdin.write(b"RuntimeError: the last words\n" + banner.encode() + b"\nan orphan's line\n")
        writer.stdin.flush()
        threading.Timer(0.5, os.kill, (writer.pid, signal.SIGCONT)).start()
        tail = attempt_tail(log, banner)
        assert failure_line(tail) == "RuntimeError: the last words"
        assert "orphan" not in tail and banner not in tail
    finally:
        os.kill(writer.pid, signal.SIGCONT)
        writer.stdin.close()
        writer.wait(20)


def test_log_writer_rotates_by_rename_log_viewer_and_failure_line(tmp_path: Path) -> None:
    """The stage's output goes through its log writer, which renames stage.log to stage.1.log past the
    limit (never copies): the log viewer notices the new file and re-indexes (no stale line), the failure
    line is in the current file, and the generations stay within limit x 3."""
    log = tmp_path / "stages" / "a" / "stage.log"
    log.parent.mkdir(parents=True)
    writer = _log_writer(log, 10_000)
    assert writer.stdin is not None
    writer.stdin.write(b"".join(b"step %d ok\n" % i for i in range(800)))
    writer.stdin.flush()
    wait_for(lambda: log.exists() and log.stat().st_size >= 9400, 20, "the first lines written")
    index = LogIndex(LocalTransport(str(tmp_path)), "stages/a/stage.log")

    async def go() -> list[str]:
        await index.update()
        first = index.lines
        assert first == 800
        assert writer.stdin is not None
        writer.stdin.write(b"x" * 700 + b"\n")
        writer.stdin.write(b"RuntimeError: CUDA error: an illegal memory access was encountered\n")
        writer.stdin.close()
        assert writer.wait(20) == 0
        await index.update()
        return [r.text for r in await index.read_lines(0, 10)]

    rows = asyncio.run(go())
    assert rows[0].startswith("----- aerie: stage.log rotated") and "stage.1.log" in rows[0]
    assert rows[-1] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert index.resets == 1
    assert (tmp_path / "stages" / "a" / "stage.1.log").read_bytes().startswith(b"step 0 ok\n")
    assert "illegal memory access" in failure_line(attempt_tail(log, ""))  # across the rotation
    sizes = [p.stat().st_size for p in log.parent.glob("stage*.log")]
    assert len(sizes) <= 3 and all(s <= 10_000 for s in sizes), sizes


def test_log_writer_bounds_a_fast_writer_and_keeps_the_last_lines(tmp_path: Path) -> None:
    """A writer far faster than any limit (20 MB through a 64 KiB limit): the stage log stays within
    limit x (kept + 1), whole lines are never split, the newest bytes are in the current file; a line
    longer than the limit is cut at it instead of growing one file without bound."""
    log = tmp_path / "stage.log"
    writer = _log_writer(log, 65536)
    assert writer.stdin is not None
    line = b"0123456789" * 9 + b"\n"
    for _ in range(200):
        writer.stdin.write(line * 1000)
    writer.stdin.write(b"y" * 300_000 + b"\n")
    writer.stdin.write(b"the last line\n")
    writer.stdin.close()
    assert writer.wait(60) == 0
    files = sorted(tmp_path.glob("stage*.log"))
    assert [p.name for p in files] == ["stage.1.log", "stage.2.log", "stage.log"]
    assert all(p.stat().st_size <= 65536 for p in files)
    assert log.read_bytes().endswith(b"y\nthe last line\n")
    body = (tmp_path / "stage.2.log").read_bytes().split(b"\n", 1)[1]  # after the rotation note
    assert all(ln == line[:-1] for ln in body.split(b"\n")[:-1] if not ln.startswith(b"y"))


# ------------------------------------------------------------------------------------ a real run
WORKER = """
import sys, time
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
(ctx.out / "result.txt").write_text("done")
(ctx.out / "sub").mkdir()
for i in range(400):
    ctx.progress(i + 1, 400, unit="steps", force=True)
    ctx.metric("loss", 1.0 / (i + 1), step=i)
    print("training step", i, "x" * 200, flush=True)
    time.sleep(0.005)
"""


@pytest.mark.slow
def test_real_run_private_and_rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run under ``umask 000`` with small limits: every file and directory under the run dir has
    no group/other bit (rotated generations, requests, the audit log, the stage's own outputs included);
    events, the stage log, the supervisor's log and the audit log rotated; the supervisor derived the
    final progress across the rotations."""
    # supervisor.log: 150 bytes, under two of its lines whatever the run path's length (at 400 whether the
    # first supervisor reached the limit hung on the path and on whether SIGTERM came before its last line)
    for kind, n in (("EVENTS", 4000), ("LOG", 20000), ("SUPERVISOR", 150), ("AUDIT", 300)):
        monkeypatch.setenv(f"AERIE_ROTATE_BYTES_{kind}", str(n))
    (tmp_path / "w.py").write_text(WORKER)
    old = os.umask(0)
    try:
        run = make_run(
            tmp_path,
            f"""
            [run]
            name = "private"
            dir = "run"
            [[stage]]
            id = "work"
            command = "{sys.executable} {tmp_path / "w.py"}"
            [[stage]]
            id = "bad"
            command = "echo 'ValueError: the reason'; exit 3"
            """,
        )
        sup = start_supervisor(run)
        try:
            assert wait_done(run, timeout=120) == {"work": "succeeded", "bad": "failed"}
        finally:
            stop(sup)
        for attempt in (2, 3):  # control actions: requests/, audit.jsonl (ctl starts a supervisor again)
            assert ctl(run, "retry", "bad").returncode == 0
            # this retry's own end: the last run's "done" snapshot is still there until it starts
            wait_for(lambda a=attempt: _retry_done(run, a), 60, f"attempt {attempt} of bad to finish")
    finally:
        os.umask(old)
    _assert_private(run)
    sd = run.stage("work")
    assert (sd.path / "events.1.jsonl").exists() and (sd.path / "stage.1.log").exists()
    assert (run.root / "supervisor.1.log").exists() and (run.root / "audit.1.jsonl").exists()
    snap = read_json(run.state_path)
    assert snap["supervisor"]["pid"] != sup.pid  # a supervisor that read the rotated events afresh ...
    state = {s["id"]: s for s in snap["stages"]}
    assert state["work"]["attempt"] == 1 and state["work"]["progress"]["done"] == 400  # ... lost nothing
    fresh = read_all(sd.events)
    assert fresh[0].type == "started" and fresh[0].get("attempt") == 1
    assert fresh[-1].type == "finished" and fresh[-1].get("status") == "succeeded"
    assert [e["stage"] for e in audit.status_section(run.root)["entries"]] == ["bad", "bad"]


def _assert_private(run: RunDir) -> None:
    loose = []
    for top, dirs, files in os.walk(run.root):
        for name in [*dirs, *files]:
            p = Path(top) / name
            try:
                mode = p.lstat().st_mode
            except FileNotFoundError:  # a snapshot's temp file, renamed into place by a supervisor ending
                continue
            if not stat.S_ISLNK(mode) and mode & 0o077:
                loose.append(f"{p.relative_to(run.root)} {oct(mode & 0o777)}")
    assert run.root.stat().st_mode & 0o077 == 0
    assert (run.stage("work").out / "result.txt").exists()
    assert not loose, loose


def test_supervisor_log_rotates_with_its_stdout(tmp_path: Path) -> None:
    """The supervisor's log rotates past its limit, and the process's stdout/stderr (where a traceback
    would go: spawn_detached points them at the log) follow it to the new file."""
    code = (
        "import os, sys\nfrom pathlib import Path\nfrom pipeline.run.rundir.growth import RotatingLog\n"
        "p = Path(sys.argv[1])\nfd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)\n"
        "os.dup2(fd, 1); os.dup2(fd, 2)\nlog = RotatingLog(p)\n"
        "for i in range(40):\n    log.write(f'line {i} ' + 'x' * 40 + '\\n')\n"
        "print('stdout after the rotations', flush=True)\n"
        "print('stderr after the rotations', file=sys.stderr, flush=True)\n"
    )
    log = tmp_path / "supervisor.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_ROTATE_BYTES_SUPERVISOR="500")
    subprocess.run([sys.executable, "-c", code, str(log)], env=env, check=True)
    current = log.read_text()
    assert "stdout after the rotations" in current and "stderr after the rotations" in current
    assert "line 39 " in current
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "supervisor.1.log",
        "supervisor.2.log",
        "supervisor.log",
    ]
    kept = "".join(p.read_text() for p in (tmp_path / "supervisor.2.log", tmp_path / "supervisor.1.log", log))
    numbers = [int(ln.split()[1]) for ln in kept.splitlines() if ln.startswith("line ")]
    assert numbers == list(range(numbers[0], 40))  # the newest kept whole, in order
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.iterdir())


def test_carried_head_is_the_latest_state_per_key(tmp_path: Path) -> None:
    """The carried head (read from the file's end, decoding only unseen keys) is what a decode of every
    line finds: the latest ``started`` and, after it, the latest event per progress key, metric name and
    label, message code, health and finished — with keys that hold quotes and backslashes, a message whose
    text looks like a key, garbage lines and a torn last line."""
    import random

    from pipeline.run.rundir.event_carry import carry_lines
    from pipeline.run.rundir.events import decode

    def every_line(path: Path) -> list[tuple[str, dict]]:
        started, latest, where = None, {}, {}
        for n, raw in enumerate(path.read_bytes().split(b"\n")[:-1]):
            try:
                ev = decode(raw)
            except ValueError:
                continue
            where[id(ev)] = n
            if ev.type == "started":
                started, latest = ev, {}
            elif ev.type in ("health", "finished"):
                latest[(ev.type,)] = ev
            elif ev.type == "progress":
                latest[("p", ev.get("key"))] = ev
            elif ev.type == "metric":
                latest[("m", ev.get("name"), ev.get("label"))] = ev
            elif ev.type == "message" and ev.get("code"):
                latest[("c", "pause" if ev.get("code") in ("paused", "resumed") else ev.get("code"))] = ev
        out = ([started] if started else []) + sorted(latest.values(), key=lambda e: where[id(e)])
        return [(e.type, e.data) for e in out]

    rng = random.Random(37)
    for trial in range(12):
        path = tmp_path / f"events{trial}.jsonl"
        with EventWriter(path, rotate_bytes=0) as w:
            for i in range(rng.randint(0, 1500)):
                r = rng.random()
                if r < 0.01:
                    w.emit("started", attempt=rng.randint(1, 3), pid=1)
                elif r < 0.5:
                    w.emit("progress", done=i, total=2000, key=rng.choice([None, "a", 'q"x']))
                elif r < 0.9:
                    w.emit(
                        "metric",
                        name=rng.choice(["loss", "n\\m"]),
                        value=rng.random(),
                        label=rng.choice([None, "x"]),
                    )
                elif r < 0.95:
                    code = rng.choice([None, "paused", "resumed", "ready"])
                    w.emit("message", text='says "name":"zz"', level="info", code=code)
                else:
                    w.emit("health", state=rng.choice(["ready", "starting"]))
        with path.open("ab") as fh:
            fh.write(b"garbage\n" if trial % 2 else b'{"type":"progress","t":1,')
        carried = [decode(ln) for ln in carry_lines(path).splitlines()]
        assert all(e.get(CARRIED) for e in carried)
        assert [(e.type, {k: v for k, v in e.data.items() if k != CARRIED}) for e in carried] == every_line(
            path
        )


async def test_log_screen_after_a_rotation_shows_the_new_file(tmp_path: Path) -> None:
    """The log screen, scrolled to the top of a long log (not following), when the log writer rotates
    it: it shows the new file's lines, never the old content at the old line numbers."""
    from console.app import AerieApp
    from tests.runs import finished_run
    from tests.test_console import until
    from tests.test_logview import open_log, screen_text

    run = finished_run(tmp_path / "r")
    log = run.stage("prep.sharegpt").log
    log.write_text("".join(f"old line {i}\n" for i in range(3000)))
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
    async with app.run_test(size=(120, 30)) as pilot:
        scr = await open_log(pilot, app)
        view = scr.view
        await until(pilot, lambda: view.total == 3000, what="the old log indexed")
        await pilot.press("g")  # the top: not following
        await until(pilot, lambda: "old line 0" in screen_text(view)[0], what="the top")
        writer = _log_writer(log, log.stat().st_size)  # full: its first write rotates it
        assert writer.stdin is not None
        writer.stdin.write(b"new line after the rotation\n")
        writer.stdin.close()
        assert writer.wait(20) == 0
        await until(pilot, lambda: view.total == 2, what="the new file indexed")
        await until(
            pilot, lambda: screen_text(view)[1].endswith("new line after the rotation"), what="new lines"
        )
        shown = "\n".join(screen_text(view))
        assert "old line" not in shown and "stage.1.log" in screen_text(view)[0]


def test_a_frozen_lock_holder_never_blocks_a_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused stage is SIGSTOPped wherever it is — maybe holding the events file's lock. The
    supervisor's own event write must not wait for its resume: past the lock wait it writes anyway, and
    a rotation that cannot get the lock is put off, never fatal."""
    import signal

    monkeypatch.setattr(growth, "LOCK_WAIT_S", 0.3)
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "300")
    path = tmp_path / "events.jsonl"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,sys,time\nf=open(sys.argv[1],'ab')\nfcntl.flock(f,fcntl.LOCK_SH)\n"
            "print('held',flush=True)\ntime.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        os.kill(holder.pid, signal.SIGSTOP)  # frozen while holding it
        with EventWriter(path) as w:
            for i in range(10):  # past the limit: each rotation attempt times out, the writes go on
                w.emit("progress", done=i, total=10)
        assert _done(read_all(path)) == list(range(10))
        assert not (tmp_path / "events.1.jsonl").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with EventWriter(path) as w:  # the holder gone: the put-off rotation happens
        w.emit("progress", done=10, total=10)
    assert (tmp_path / "events.1.jsonl").exists()


def test_the_carried_head_read_before_the_lock_equals_one_read_under_it(tmp_path: Path) -> None:
    """Rotation reads the generation before it takes its lock, then only what was appended meanwhile: the
    head is the same as one read of the whole file, whatever was appended (newer values, a new attempt),
    and a line longer than any event is skipped unread, not carried."""
    from pipeline.run.rundir.event_carry import carry_lines, carry_scan

    path = tmp_path / "events.jsonl"
    with EventWriter(path, rotate_bytes=0) as w:
        w.emit("started", attempt=1, pid=1)
        for i in range(50):
            w.emit("progress", done=i, total=100)
            w.emit("metric", name="loss", value=1.0 / (i + 1))
    with open(path, "ab") as fh:
        fh.write(b'{"type":"message","t":1,"level":"info","code":"big","text":"' + b"x" * (3 << 20) + b'"}\n')
    for more in (
        [("progress", {"done": 60, "total": 100}), ("health", {"state": "ready"})],
        [("started", {"attempt": 2, "pid": 2}), ("metric", {"name": "acc", "value": 0.5})],
    ):
        before = carry_scan(path)
        with EventWriter(path, rotate_bytes=0) as w:
            for kind, data in more:
                w.emit(kind, **data)
        assert carry_lines(path, before) == carry_lines(path)
        head = [json.loads(ln) for ln in carry_lines(path).splitlines()]
        assert all(e.get("code") != "big" for e in head)  # 3 MiB: longer than any event, skipped
        if more[0][0] == "progress":
            assert [e["type"] for e in head] == ["started", "metric", "progress", "health"]
            assert head[2]["done"] == 60
    assert [e["type"] for e in head] == ["started", "metric"] and head[0]["attempt"] == 2


async def test_a_console_and_aerie_watch_attached_after_alerts_rotated_list_what_aerie_status_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alert #1 was raised, cleared and acknowledged; then alerts.jsonl rotated (a limit of 1 byte here), and
    its new file's head carries only what is open or unacknowledged (#2). A console model and ``aerie watch``
    started after that read the kept generation too: they list #1 as ``aerie status`` (record.read) does."""
    import io

    from console.watch import Delivered, Watch
    from pipeline.run.alerts import record

    run = make_run(tmp_path, '[run]\nname = "r"\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')
    one = record.AlertRecord(1, "stalled:a:1:t1", "stalled", "a", 1, "a stalled", "no progress", [], 1.0)
    monkeypatch.setenv("AERIE_ROTATE_BYTES_ALERTS", "0")  # no rotation while #1 is written
    record.append(
        run.root,
        [record.raised_line(one), record.cleared_line(1, 2.0), record.ack_line(1, "ana@laptop", 3.0)],
    )
    monkeypatch.setenv("AERIE_ROTATE_BYTES_ALERTS", "1")  # past the limit: this append rotates the file
    two = record.AlertRecord(2, "disk:-:0:t4", "disk", "", 0, "disk", "the disk fills", [], 4.0)
    record.append(run.root, [record.raised_line(two)])
    current = (run.root / "alerts.jsonl").read_text()
    assert '"id": 1' not in current and (run.root / "alerts.1.jsonl").exists(), "#1 lives only in .1"
    status = {r.id: (r.open, r.acked_by) for r in record.read(run.root).values()}
    assert status == {1: (False, "ana@laptop"), 2: (True, None)}

    model = RunModel(LocalTransport(str(run.root)), backfill=False)
    assert "alerts" in await model.poll()
    assert {r.id: (r.open, r.acked_by) for r in model.alerts.ordered()} == status
    assert [r.id for r in model.alerts.ordered()] == [2, 1], "open first, as aerie status lists them"

    out = io.StringIO()
    w = Watch(LocalTransport(str(run.root)), Delivered(tmp_path / "home", str(run.root)), [], 5.0, out=out)
    assert await w.poll() and await w.deliver_new() == 2
    assert "alert #1 stalled a: no progress" in out.getvalue() and "alert #2 disk" in out.getvalue()
