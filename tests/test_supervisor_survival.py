"""The supervisor survives its faults, exactly one runs per run, and the front ends notice and restart a dead one.

Real supervisors, real launchers, a real read-only bind mount of the run directory (needs root: CI runs as
root), real ``ctl`` and ``aerie`` processes, the real headless front end over the local transport.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from console import headless, sup_watch
from console.transport import LocalTransport
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from pipeline.run.supervise.liveness import STALE_S, liveness, lock_holders
from tests.runs import (
    ROOT,
    ctl,
    kill_run_stages,
    make_run,
    stage_state,
    start_supervisor,
    states,
    stop,
    wait_done,
    wait_for,
)


def supervisor_processes(run: RunDir) -> list[int]:
    """Every live process that is a supervisor of ``run`` (by its command line; not by name alone)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"pipeline.run.supervise.supervisor" in argv and str(run.root).encode() in argv:
            pids.append(int(d.name))
    return sorted(pids)


def alerts(run: RunDir) -> list[dict]:
    return ((read_json(run.state_path) or {}).get("supervisor") or {}).get("alerts") or []


class ReadOnlyBind:
    """A read-only bind mount of a directory over itself: its writers see EROFS until :meth:`writable`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False

    def _mount(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", *args], capture_output=True, text=True)

    def read_only(self) -> None:
        if os.geteuid() != 0:
            pytest.skip("needs root to bind-mount the run directory read-only")
        if not self.mounted:
            r = self._mount("--bind", str(self.path), str(self.path))
            if r.returncode:
                pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
            self.mounted = True
        r = self._mount("-o", "remount,bind,ro", str(self.path))
        if r.returncode:
            pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")

    def writable(self) -> None:
        if self.mounted:
            r = self._mount("-o", "remount,bind,rw", str(self.path))
            assert r.returncode == 0, r.stderr

    def close(self) -> None:
        if self.mounted:
            self.writable()
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False


@pytest.fixture
def cleanup() -> Iterator[list]:
    items: list = []
    yield items
    for item in reversed(items):
        if isinstance(item, ReadOnlyBind):
            item.close()
        elif isinstance(item, subprocess.Popen):
            stop(item)
        else:
            kill_run_stages(item)
            for pid in supervisor_processes(item):
                os.kill(pid, signal.SIGTERM)


TWO_STEPS = """
[run]
name = "survive"
dir = "run"
[[stage]]
id = "a"
command = "sleep {sleep}"
[[stage]]
id = "b"
command = "true"
after = ["a"]
"""


@pytest.mark.slow
def test_a_read_only_run_dir_is_survived_shown_and_the_run_carries_on(tmp_path: Path, cleanup: list) -> None:
    run = make_run(tmp_path, TWO_STEPS.format(sleep=12))
    cleanup.append(run)
    sup = start_supervisor(run)
    cleanup.append(sup)
    wait_for(lambda: stage_state(run, "a").get("pid"), 20, "a running (its launcher recorded its pid)")
    ro = ReadOnlyBind(run.root)
    cleanup.append(ro)
    ro.read_only()
    with pytest.raises(OSError):
        (run.root / "probe").write_text("x")
    # Its next snapshot (at the latest a heartbeat later) fails; its log, open before, still takes lines.
    wait_for(lambda: "ALERT write_failed" in run.supervisor_log.read_text(), 15, "a failed write")
    time.sleep(1.0)  # a few retries
    assert sup.poll() is None, "the supervisor died of a read-only run directory"
    # A control verb meanwhile: one line and exit 5 (its request could not be queued), never a traceback.
    r = ctl(run, "pause", "a")
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Read-only file system" in r.stderr, r.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "console.cli", "pause", str(run.root), "a"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert cli.returncode == 5 and "Traceback" not in cli.stderr and "Read-only" in cli.stderr, cli.stderr
    # Were the silence to last, the front ends would say why: the lock is held, the dir cannot be written.
    later = liveness(run, read_json(run.state_path), now=time.time() + STALE_S + 5)
    assert later["verdict"] == "silent" and later["pid"] == sup.pid, later
    assert "cannot write: EROFS" in later["text"] and f"pid {sup.pid} alive" in later["text"], later
    ro.writable()
    # The first snapshot written afterwards carries the alert (state.json, and aerie status).
    wait_for(lambda: any(a["code"] == "write_failed" for a in alerts(run)), 40, "the alert in state.json")
    found = [a for a in alerts(run) if a["code"] == "write_failed"]
    assert len(found) == 1, found
    (alert,) = found
    assert "EROFS Read-only file system" in alert["text"] and alert["path"].endswith("state.json")
    assert wait_done(run, 60) == {"a": "succeeded", "b": "succeeded"}
    assert sup.wait(20) == 0
    ended = [a for a in alerts(run) if a["code"] == "write_failed"]
    assert ended and ended[0]["resolved"], "the alert is shown as ended once state.json is written again"
    log = run.supervisor_log.read_text()
    assert "Traceback" not in log and "ALERT write_failed" in log and "resolved write_failed" in log
    status = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert "supervisor alert (" in status.stdout and "ended): cannot write the run directory" in status.stdout


CORRUPT = """
[run]
name = "corrupt"
dir = "run"
[resources]
cpu_slots = 4
[[stage]]
id = "a"
command = "true"
[[stage]]
id = "b"
command = "true"
[[stage]]
id = "c"
command = "true"
after = ["a"]
[[stage]]
id = "d"
command = "true"
"""


def test_a_damaged_stage_file_holds_only_that_stage_and_is_named(tmp_path: Path, cleanup: list) -> None:
    run = make_run(tmp_path, CORRUPT)
    cleanup.append(run)
    (run.stage("b").attempt_file).write_text("\x00garbage{")  # not JSON
    (run.stage("d").launch).write_text(json.dumps({"attempt": "one", "t": 1.0}))  # JSON, wrong type
    sup = start_supervisor(run)
    cleanup.append(sup)
    wait_for(lambda: {states(run).get(s) for s in ("a", "c")} == {"succeeded"}, 30, "a and c to finish")
    assert sup.poll() is None
    b, d = stage_state(run, "b"), stage_state(run, "d")
    assert b["state"] != "running" and "stages/b/attempt.json is not valid JSON" in b["reason"], b
    assert "treated as attempt 1" in b["reason"] and "fixed or deleted" in b["reason"]
    assert "stages/d/launch.json has no whole attempt number" in d["reason"], d
    by_path = {Path(a["path"]).relative_to(run.root).as_posix(): a for a in alerts(run)}
    assert by_path["stages/b/attempt.json"]["code"] == "corrupt_file"
    assert by_path["stages/d/launch.json"]["stage"] == "d"
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    ).stdout
    assert "stages/b/attempt.json is not valid JSON" in out and "supervisor alert (since" in out, out
    # A control action on the held stage is refused, naming the file; retry is what repairs attempt.json.
    r = ctl(run, "skip", "d")
    assert r.returncode == 3 and "stages/d/launch.json" in r.stderr, r.stderr
    # Fixed (deleted): the stages run, the alerts end, nothing else was touched.
    run.stage("b").attempt_file.unlink()
    run.stage("d").launch.unlink()
    assert wait_done(run, 40) == dict.fromkeys("abcd", "succeeded")
    assert all(a["resolved"] for a in alerts(run)), alerts(run)
    assert "Traceback" not in run.supervisor_log.read_text()


def test_each_damaged_record_is_named_and_nothing_is_overwritten(tmp_path: Path) -> None:
    """In process: a damaged spec.json (the stage is followed by the plan's definition, started once the file
    is deleted and written again from the plan), a proc.json whose pid is not a number and an exit.json that
    is not JSON (their stages held), each named; no damaged file is rewritten."""
    from pipeline.run.supervise.supervisor import Supervisor

    run = make_run(tmp_path, CORRUPT)
    run.stage("a").spec.write_text('{"id": ')
    write_json(run.stage("b").launch, {"attempt": 1, "t": time.time()})
    write_json(run.stage("b").proc, {"attempt": 1, "pid": "x", "pgid": 1, "start_time": 1, "t": 1.0})
    write_json(run.stage("d").launch, {"attempt": 1, "t": time.time()})
    run.stage("d").exit.write_text('{"attempt": 1, "returncode": 0')
    before = {p: p.read_bytes() for p in run.stages_dir.rglob("*") if p.is_file()}
    sup = Supervisor(run)
    sup.refresh()
    assert sup.write_state(force=True)
    rows = {st["id"]: st for st in read_json(run.state_path)["stages"]}
    assert rows["a"]["state"] == "pending" and sup.specs["a"].command == "true"  # not started: see below
    assert "stages/b/proc.json has no whole pid" in rows["b"]["reason"], rows["b"]
    assert "stages/d/exit.json is not valid JSON" in rows["d"]["reason"], rows["d"]
    assert "held at its last known state" in rows["d"]["reason"]
    texts = {a["stage"]: a["text"] for a in alerts(run)}
    assert "stages/a/spec.json is unreadable" in texts["a"] and "not started" in texts["a"]
    assert set(texts) == {"a", "b", "d"}
    assert sup.schedule() == 0  # a waits for its spec.json (its launcher reads it); b and d are held
    assert {p: p.read_bytes() for p in before} == before, "a damaged file was rewritten"
    run.stage("a").spec.unlink()  # deleted: written again from the plan, and a starts
    sup.refresh()
    assert read_json(run.stage("a").spec)["command"] == "true"
    assert sup.schedule() == 1
    wait_for(lambda: read_json(run.stage("a").exit), 20, "a to finish")
    assert read_json(run.stage("a").exit)["returncode"] == 0
    assert [a["resolved"] is not None for a in sup.faults.section()] == [True, False, False]


def test_deleting_the_lock_files_never_makes_a_second_supervisor(tmp_path: Path, cleanup: list) -> None:
    run = make_run(tmp_path, TWO_STEPS.format(sleep=30))
    cleanup.append(run)
    sup = start_supervisor(run)
    cleanup.append(sup)
    wait_for(lambda: states(run).get("a") == "running", 20, "a running")
    assert lock_holders(run.root) == [sup.pid]
    run.lock_path.unlink()
    run.supervisor_path.unlink()
    r = ctl(run, "pause", "a")  # ctl finds the lock held: it starts none, and the one supervisor answers
    assert r.returncode == 0 and "pause requested" in r.stdout, (r.stdout, r.stderr)
    second = start_supervisor(run)  # started by hand as well: it finds the run locked and leaves
    assert second.wait(10) == 0
    time.sleep(1.0)  # time enough for any supervisor started by mistake to attach
    assert supervisor_processes(run) == [sup.pid]
    assert lock_holders(run.root) == [sup.pid]
    assert run.supervisor_log.read_text().count("attached to") == 1
    # supervisor.json is information only, but the live supervisor writes it again on its next tick.
    wait_for(lambda: run.supervisor_path.exists(), 10, "supervisor.json rewritten")
    assert read_json(run.supervisor_path)["pid"] == sup.pid
    live = json.loads(ctl(run, "liveness").stdout)
    assert live["verdict"] == "running" and live["holders"] == [sup.pid] and live["pid_alive"]
    assert ctl(run, "kill", "a").returncode == 0


async def _follow_until(
    run: RunDir, read_only: bool, done: object, timeout: float
) -> tuple[io.StringIO, asyncio.Task[int]]:
    """Headless mode following ``run`` (as a task) until ``done(its output)`` or ``timeout``."""
    out = io.StringIO()
    task = asyncio.create_task(
        headless.follow(LocalTransport(str(run.root)), out=out, poll_s=0.2, read_only=read_only)
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done(out.getvalue()):  # type: ignore[operator]
        await asyncio.sleep(0.2)
    return out, task


@pytest.mark.slow
def test_a_sigkilled_supervisor_is_noticed_and_restarted_by_the_front_end(
    tmp_path: Path, cleanup: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ask the host sooner than the default 12 s (the supervisor writes a snapshot at least every 5 s).
    monkeypatch.setattr(sup_watch, "STALE_S", 7.0)
    run = make_run(tmp_path, TWO_STEPS.format(sleep=60))
    cleanup.append(run)
    sup = start_supervisor(run)
    # Started, not only "starting": the stage must outlive the supervisor (its launcher reported its pid).
    wait_for(lambda: stage_state(run, "a").get("pid"), 20, "a started")
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait()

    async def scenario() -> tuple[str, str]:
        # A read-only watcher says the supervisor is dead and that it is not restarting it.
        ro_out, task = await _follow_until(run, True, lambda o: "not restarting it" in o, 30)
        task.cancel()
        assert lock_holders(run.root) == [], "a read-only watcher started a supervisor"
        # The console's headless mode restarts it — not only when it attaches: this one attached before
        # the new supervisor is killed again below.
        rw_out, task2 = await _follow_until(run, False, lambda o: False, 2)
        first = lock_holders(run.root)
        assert len(first) == 1, first  # started on attach
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: lock_holders(run.root) == [], 5, "the lock released")
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not (
            lock_holders(run.root) and lock_holders(run.root) != first
        ):
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        task2.cancel()
        return ro_out.getvalue(), rw_out.getvalue()

    said, said2 = asyncio.run(scenario())
    assert "supervisor dead (last seen" in said and "read-only watcher" in said, said
    assert "supervisor dead (last seen" in said2 and "restarting it" in said2, said2
    holders = lock_holders(run.root)
    assert len(holders) == 1 and supervisor_processes(run) == holders, "restarted, and only one"
    wait_for(
        lambda: (read_json(run.state_path) or {}).get("supervisor", {}).get("pid") == holders[0],
        15,
        "the new supervisor's snapshot",
    )
    assert states(run)["a"] == "running", "the stage kept running under the restarted supervisor"
    assert ctl(run, "kill", "a").returncode == 0


@pytest.mark.slow
async def test_the_console_restarts_a_supervisor_that_dies_while_it_is_attached(
    tmp_path: Path, cleanup: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    from textual.widgets import Static

    from console.app import AerieApp

    monkeypatch.setattr(sup_watch, "STALE_S", 7.0)  # as above: ask the host sooner than the default
    run = make_run(tmp_path, TWO_STEPS.format(sleep=60))
    cleanup.append(run)
    sup = start_supervisor(run)
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2)
    notes: list[
        str
    ] = []  # every notification shown (a toast expires, and leaves app._notifications, in 10 s)
    shown = app.notify

    def notify(message: str, **kw: Any) -> None:
        notes.append(str(message))
        shown(message, **kw)

    app.notify = notify  # type: ignore[method-assign]

    async def until(pred: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():  # type: ignore[operator]
                return
            await pilot.pause(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    seen: list[str] = []

    def status_line() -> str:
        text = str(app.query_one("#status-line", Static).content)
        if not seen or seen[-1] != text:
            seen.append(text)
        return text

    async with app.run_test(size=(140, 36)) as pilot:
        await until(lambda: app.model.stages.get("a") and app.model.stages["a"].state == "running", 20, "a")
        await until(lambda: stage_state(run, "a").get("pid"), 20, "a started")  # not only "starting"
        os.killpg(sup.pid, signal.SIGKILL)
        sup.wait()
        # The console notices and restarts it; under load the restart can land between two looks at the status
        # line, so the "dead — restarting it" line is checked when seen, and the notification below always.
        await until(
            lambda: bool(status_line()) and lock_holders(run.root) not in ([], [sup.pid]),
            40,
            "a new supervisor",
        )
        dead = [line for line in seen if "supervisor dead (last seen" in line]
        assert all("restarting it" in line for line in dead), seen
        new = lock_holders(run.root)
        await until(lambda: app.model.supervisor_pid == new[0], 20, "the new supervisor's snapshot")
        await until(lambda: status_line().startswith(f"supervisor pid {new[0]}"), 10, "the all-clear")
    assert any("supervisor dead" in n and "started a new one" in n for n in notes), notes
    assert supervisor_processes(run) == new
    assert ctl(run, "kill", "a").returncode == 0


async def _attach_and_collect_notes(run: RunDir, seconds: float) -> list[str]:
    """Open the console on ``run`` for ``seconds`` and return every notification it showed."""
    from console.app import AerieApp

    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2)
    notes: list[str] = []
    shown = app.notify

    def notify(message: str, **kw: Any) -> None:
        notes.append(str(message))
        shown(message, **kw)

    app.notify = notify  # type: ignore[method-assign]
    async with app.run_test(size=(140, 36)) as pilot:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not lock_holders(run.root):
            await pilot.pause(0.1)
        await pilot.pause(1.0)  # the check's answer reaches the app after the supervisor took the lock
    return notes


@pytest.mark.slow
async def test_attaching_to_a_run_whose_supervisor_died_says_the_console_restarted_it(
    tmp_path: Path, cleanup: list
) -> None:
    """Under load the attach-time check can be the one that finds the supervisor dead: it says so, whether
    the console saw that supervisor alive or not; a finished run's restart on attach stays quiet."""
    run = make_run(tmp_path, TWO_STEPS.format(sleep=60))
    cleanup.append(run)
    sup = start_supervisor(run)
    wait_for(lambda: stage_state(run, "a").get("pid"), 20, "a started")  # not only "starting"
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait()
    notes = await _attach_and_collect_notes(run, 30)
    assert len(lock_holders(run.root)) == 1, "the console restarted the supervisor on attach"
    assert any("supervisor dead" in n and "started a new one" in n for n in notes), notes
    assert ctl(run, "kill", "a").returncode == 0

    (tmp_path / "done").mkdir()
    done = make_run(tmp_path / "done", TWO_STEPS.format(sleep=0))
    cleanup.append(done)
    sup2 = start_supervisor(done)
    wait_done(done)
    sup2.wait(20)  # a supervisor exits once every stage has finished
    quiet = await _attach_and_collect_notes(done, 30)
    assert not any("started a new one" in n for n in quiet), quiet
