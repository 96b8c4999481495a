"""An attempt is known without its ``proc.json`` (issue 46, item 5): a damaged or deleted record never leads to
a second live attempt; retry, automatic retry, skip and launch refuse while any process of the stage lives;
``aerie kill`` finds its processes by the marks the launcher put in their environment, or says it cannot.

Real supervisors on real operator ``command`` stages (the tree of :mod:`tests.test_proctree`: one child in
the stage's group, one that left it with ``setsid``); every pid a test saw is SIGKILLed when it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.run.hosts.local_exec import LAUNCHER_SCRIPT
from pipeline.run.hosts.procs import ProcIdentity, boot_id, env_with_pipeline, read_stat, signal_attempt
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.layout import read_json, write_json
from tests.runs import ctl, make_run, pid_alive, stage_state, start_supervisor, states, wait_done, wait_for
from tests.test_proctree import Pids, tree_run


@pytest.fixture
def seen() -> Iterator[Pids]:
    """Every pid a test saw, SIGKILLed when it ends (the runs' recorded attempts too)."""
    p = Pids()
    try:
        yield p
    finally:
        p.cleanup()


def _kill_supervisor(sup: subprocess.Popen) -> None:
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait(10)


def test_a_deleted_proc_json_never_leads_to_a_second_attempt(tmp_path: Path, seen: Pids) -> None:
    """The issue's repro: proc.json damaged then deleted under a live attempt, the supervisor SIGKILLed and
    started again, the launch long past its timeout: the stage stays running (followed by its marks), the
    automatic retry never starts attempt 2, and `aerie kill` reaches every process, the setsid one too."""
    run = tree_run(tmp_path, retry="retry = { max_attempts = 3, backoff_s = 0.2 }")
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    in_group = seen.read(tmp_path / "group.1.pid")
    left_group = seen.read(tmp_path / "setsid.1.pid")
    sd = run.stage("train")
    ident = ProcIdentity.from_dict(read_json(sd.proc))
    seen.add(ident.pid)
    sd.proc.write_text("garbage")
    sd.proc.unlink()
    _kill_supervisor(sup)
    launch = read_json(sd.launch)
    write_json(sd.launch, {**launch, "t": time.time() - 3600})  # an attempt started an hour ago
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    reason = wait_for(
        lambda: (
            "proc.json missing" in (stage_state(run, "train").get("reason") or "")
            and stage_state(run, "train")["reason"]
        ),
        20,
        "the attempt followed by its marks",
    )
    assert str(left_group) in str(reason) and str(in_group) in str(reason)
    time.sleep(2)  # several ticks: nothing counts it lost, nothing retries it
    assert states(run)["train"] == "running"
    assert (tmp_path / "starts.log").read_text().split() == ["1"]
    retry = ctl(run, "retry", "train")
    assert retry.returncode == 3 and "running" in retry.stderr
    kill = ctl(run, "kill", "train")
    assert kill.returncode == 0, kill.stderr
    assert "found by their marks" in kill.stdout and "None" not in kill.stdout
    wait_for(lambda: not pid_alive(left_group) and not pid_alive(in_group), 20, "every process to end")
    assert wait_done(run) == {"train": "killed"}
    assert (tmp_path / "starts.log").read_text().split() == ["1"]


def test_a_kill_while_the_stage_starts_ends_it_and_never_starts_it(tmp_path: Path, seen: Pids) -> None:
    """A supervisor SIGKILLed between its launch intent and the launcher's fork leaves an attempt "starting"
    with no process at all (CI saw it). `aerie kill` then ends it at once, killed, not refused ("its proc.json
    is missing") nor left starting until the launch timeout, never "SIGTERM sent to process group None";
    nothing of the stage ever runs and nothing retries it."""
    run = tree_run(tmp_path, retry="retry = { max_attempts = 3, backoff_s = 0.2 }")
    sd = run.stage("train")
    write_json(sd.attempt_file, {"attempt": 1, "t": time.time()})
    write_json(sd.launch, {"attempt": 1, "t": time.time() + 3600, "supervisor": 1})  # far from its timeout
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    wait_for(lambda: stage_state(run, "train").get("display") == "starting", 20, "the launch followed")
    kill = ctl(run, "kill", "train")
    assert kill.returncode == 0, kill.stderr
    assert "killed while starting" in kill.stdout and "None" not in kill.stdout + kill.stderr
    assert wait_done(run, 10) == {"train": "killed"}
    assert stage_state(run, "train")["attempt"] == 1, "a kill is never retried"
    assert not (tmp_path / "group.1.pid").exists(), "the stage ran"


def test_a_launcher_that_finds_its_attempt_killed_records_it_and_never_starts_the_stage(
    tmp_path: Path, seen: Pids
) -> None:
    """The kill reached the supervisor while the launcher was still starting (before its proc.json, so no
    signal could find it): the launcher reads the kill marker, records the attempt killed and exits without
    starting the stage; the supervisor shows it killed."""
    run = tree_run(tmp_path)
    sd = run.stage("train")
    write_json(sd.attempt_file, {"attempt": 1, "t": time.time()})
    write_json(sd.launch, {"attempt": 1, "t": time.time(), "supervisor": 1})
    write_json(sd.kill_marker, {"attempt": 1, "t": time.time(), "reason": "operator"})
    launched = subprocess.run(
        [sys.executable, "-S", LAUNCHER_SCRIPT, str(run.root), "train", "1"],
        env=env_with_pipeline(),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # as the executor starts it: its recorded group is its own
    )
    assert launched.returncode == 0, launched.stderr
    assert (read_json(sd.proc) or {}).get("attempt") == 1
    assert read_json(sd.exit)["detail"] == "killed before the stage started"
    assert [e.data.get("status") for e in read_all(sd.events) if e.type == "finished"] == ["killed"]
    assert not (tmp_path / "group.1.pid").exists(), "the stage ran"
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    assert wait_done(run) == {"train": "killed"}


LEAVES_AND_FAILS = r"""
d=$1
setsid sh -c 'trap "" TERM; echo $$ > "$0/left.pid"; while [ ! -f "$0/release" ]; do sleep 0.1; done' "$d" &
while [ ! -s "$d/left.pid" ]; do sleep 0.05; done
echo "$AERIE_ATTEMPT" >> "$d/starts.log"
exit 1
"""


def test_retry_and_skip_refuse_beside_a_live_setsid_child(tmp_path: Path, seen: Pids) -> None:
    """A stage recorded failed (its exit.json) whose setsid child lives on and whose proc.json is gone:
    `aerie retry` and `aerie skip` each exit 3, name the pid and queue nothing; the automatic retry waits
    too. Once the child ends, retry works."""
    script = tmp_path / "leaves.sh"
    script.write_text(LEAVES_AND_FAILS)
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "train"
        command = "sh {script} {tmp_path}"
        kill_grace_s = 600
        retry = {{ max_attempts = 3, backoff_s = 0.2 }}
        """,
    )
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    left = seen.read(tmp_path / "left.pid")
    sd = run.stage("train")
    wait_for(lambda: sd.exit.exists(), 20, "the attempt's exit")
    sd.proc.unlink()  # the record that tied the child to the attempt
    wait_for(lambda: states(run)["train"] == "failed", 20, "the stage recorded failed")
    for action in ("retry", "skip"):
        p = ctl(run, action, "train")
        assert p.returncode == 3, (action, p.stdout, p.stderr)
        assert str(left) in p.stderr and "kill it first" in p.stderr, (action, p.stderr)
    time.sleep(1)  # the automatic retry is due: it waits too
    assert read_json(sd.attempt_file)["attempt"] == 1 and not (sd.path / "skip.json").exists()
    assert (tmp_path / "starts.log").read_text().split() == ["1"]
    assert states(run)["train"] == "failed"
    (tmp_path / "release").touch()
    wait_for(lambda: not pid_alive(left), 20, "the child to end")
    wait_for(lambda: (tmp_path / "starts.log").read_text().split()[:2] == ["1", "2"], 30, "attempt 2")


def test_a_record_from_another_boot_signals_nothing(tmp_path: Path, seen: Pids) -> None:
    """A proc.json written before a reboot names a process group that, in this boot, is a stranger's: no
    signal reaches it, and the attempt is recorded as ended by the restart."""
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    seen.strangers.append(stranger)
    st = read_stat(stranger.pid)
    assert st is not None
    other_boot = "00000000-0000-0000-0000-000000000000"
    assert other_boot != boot_id()
    ident = ProcIdentity(stranger.pid, stranger.pid, st.start_time, other_boot, "t" * 32)
    assert signal_attempt(ident, signal.SIGTERM) == []
    run = tree_run(tmp_path)
    sd = run.stage("train")
    write_json(sd.attempt_file, {"attempt": 1, "t": time.time()})
    write_json(sd.launch, {"attempt": 1, "t": time.time() - 60, "supervisor": 1})
    write_json(sd.proc, {"attempt": 1, **ident.to_dict(), "t": time.time() - 60})
    sup = start_supervisor(run)
    seen.runs.append((run, sup))
    assert wait_done(run) == {"train": "failed"}
    assert "host restarted" in (stage_state(run, "train").get("reason") or "")
    assert ctl(run, "kill", "train").returncode == 3  # not running: nothing to kill
    time.sleep(0.3)
    assert stranger.poll() is None and read_stat(stranger.pid) is not None
