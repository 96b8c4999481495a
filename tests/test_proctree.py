"""One stage, one process tree, one copy: a stage's processes outlive a `kill -9` of its launcher, but never
a kill, and no second attempt starts beside them (issue 37, item 2).

Every test runs a real supervisor on a real operator ``command`` stage whose shell starts one child in the
stage's process group and one that leaves it with ``setsid``; each writes its pid to a file, and the tests
SIGKILL every pid they recorded when they end, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.run.hosts.procs import ProcIdentity, attempt_members, read_stat
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from tests.runs import (
    ctl,
    events,
    kill_run_stages,
    make_run,
    pid_alive,
    stage_state,
    start_supervisor,
    states,
    stop,
    wait_done,
    wait_for,
)

# $1: the test's folder. One child stays in the stage's group, one leaves it (setsid); both run until
# $1/release exists. Each attempt appends its number to starts.log.
TREE = r"""
d=$1
echo "$AERIE_ATTEMPT" >> "$d/starts.log"
(while [ ! -f "$d/release" ]; do sleep 0.1; done) &
echo $! > "$d/group.$AERIE_ATTEMPT.pid"
setsid sh -c 'echo $$ > "$0/setsid.$1.pid"; while [ ! -f "$0/release" ]; do sleep 0.1; done' "$d" "$AERIE_ATTEMPT" &
wait
"""


class Pids:
    """Pids a test saw (with their start times): SIGKILLed at the end if still the same processes."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.strangers: list[subprocess.Popen] = []
        self.runs: list[tuple[RunDir, subprocess.Popen | None]] = []

    def add(self, pid: int) -> int:
        st = read_stat(pid)
        if st is not None:
            self.seen.append((pid, st.start_time))
        return pid

    def read(self, path: Path, timeout: float = 20.0) -> int:
        wait_for(lambda: path.exists() and path.read_text().strip(), timeout, f"{path.name}")
        return self.add(int(path.read_text()))

    def cleanup(self) -> None:
        for run, sup in self.runs:
            if sup is not None:
                stop(sup)
            kill_run_stages(run)
        for pid, start in self.seen:
            st = read_stat(pid)
            if st is not None and st.start_time == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in self.strangers:
            p.kill()
            p.wait()


@pytest.fixture
def pids() -> Iterator[Pids]:
    p = Pids()
    try:
        yield p
    finally:
        p.cleanup()


def tree_run(tmp_path: Path, kill_grace_s: float = 2, retry: str = "") -> RunDir:
    script = tmp_path / "tree.sh"
    script.write_text(TREE)
    return make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "train"
        command = "sh {script} {tmp_path}"
        kill_grace_s = {kill_grace_s}
        {retry}
        """,
    )


def kill_launcher(run: RunDir, pids: Pids) -> ProcIdentity:
    """`kill -9` of the pid the stage's proc.json records (the launcher), as an operator might."""
    ident = ProcIdentity.from_dict(read_json(run.stage("train").proc))
    pids.add(ident.pid)
    os.kill(ident.pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(ident.pid), 10, "the launcher to die")
    return ident


def test_killed_launcher_is_followed_retry_refused_kill_ends_the_whole_tree(
    tmp_path: Path, pids: Pids
) -> None:
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # not Aerie's: never signalled
    pids.strangers.append(stranger)
    run = tree_run(tmp_path)
    sup = start_supervisor(run)
    pids.runs.append((run, sup))
    in_group = pids.read(tmp_path / "group.1.pid")
    left_group = pids.read(tmp_path / "setsid.1.pid")
    ident = ProcIdentity.from_dict(read_json(run.stage("train").proc))
    assert read_stat(in_group).pgid == ident.pgid
    assert read_stat(left_group).pgid not in (ident.pgid, stranger.pid), "the setsid child left the group"
    assert {in_group, left_group} <= {m.pid for m in attempt_members(ident)}
    assert stranger.pid not in {m.pid for m in attempt_members(ident)}

    kill_launcher(run, pids)
    reason = wait_for(
        lambda: (
            "launcher lost" in (stage_state(run, "train").get("reason") or "")
            and stage_state(run, "train")["reason"]
        ),
        10,
        "the stage to be followed without its launcher",
    )
    assert f"pgid {ident.pgid}" in str(reason)
    for _ in range(10):  # several supervisor ticks: still running, never marked failed
        assert states(run)["train"] == "running"
        time.sleep(0.1)
    assert pid_alive(in_group) and pid_alive(left_group)
    assert read_json(run.stage("train").exit) is None

    res = ctl(run, "retry", "train")
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "kill it first" in res.stderr and f"pgid {ident.pgid}" in res.stderr
    assert str(left_group) in res.stderr
    assert (tmp_path / "starts.log").read_text().split() == ["1"], "no second copy started"

    res = ctl(run, "kill", "train")
    assert res.returncode == 0, res.stderr
    wait_for(
        lambda: not pid_alive(in_group) and not pid_alive(left_group), 10, "every process of the stage to end"
    )
    assert wait_for(lambda: states(run)["train"] == "killed", 10, "the stage to be recorded killed")
    assert attempt_members(ident) == []
    assert stranger.poll() is None, "a process Aerie did not start is never signalled"

    res = ctl(run, "retry", "train")
    assert res.returncode == 0, res.stderr
    in_group2 = pids.read(tmp_path / "group.2.pid")
    left_group2 = pids.read(tmp_path / "setsid.2.pid")
    ident2 = ProcIdentity.from_dict(read_json(run.stage("train").proc))
    assert ident2.token and ident2.token != ident.token
    assert (tmp_path / "starts.log").read_text().split() == ["1", "2"]
    assert attempt_members(ident) == [], "nothing of attempt 1 runs beside attempt 2"
    assert {in_group2, left_group2} <= {m.pid for m in attempt_members(ident2)}
    (tmp_path / "release").touch()
    assert wait_done(run) == {"train": "succeeded"}
    assert stranger.poll() is None


def test_a_new_supervisor_follows_a_stage_whose_launcher_died_and_records_its_end(
    tmp_path: Path, pids: Pids
) -> None:
    run = tree_run(tmp_path, retry="retry = { max_attempts = 1 }")
    sup = start_supervisor(run)
    pids.runs.append((run, None))
    in_group = pids.read(tmp_path / "group.1.pid")
    left_group = pids.read(tmp_path / "setsid.1.pid")
    kill_launcher(run, pids)
    wait_for(lambda: "launcher lost" in (stage_state(run, "train").get("reason") or ""), 10, "followed")
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait()
    sup2 = start_supervisor(run)
    pids.runs.append((run, sup2))
    wait_for(
        lambda: (read_json(run.state_path) or {}).get("supervisor", {}).get("pid") == sup2.pid,
        10,
        "the new supervisor",
    )
    st = stage_state(run, "train")
    assert st["state"] == "running" and "launcher lost" in st["reason"], st
    assert pid_alive(in_group) and pid_alive(left_group)

    (tmp_path / "release").touch()  # the stage's processes end on their own
    assert wait_done(run) == {"train": "failed"}
    st = stage_state(run, "train")
    assert "launcher was killed; the stage's processes ended, exit status unknown" in st["reason"]
    assert events(run, "train", "finished")[-1].get("status") == "failed"
    assert (tmp_path / "starts.log").read_text().split() == ["1"]


def test_no_attempt_starts_beside_the_processes_of_an_earlier_one(tmp_path: Path, pids: Pids) -> None:
    """Defence in depth: even when the attempt number moved on without a retry (an older Aerie's retry, a
    hand edit), the supervisor refuses to launch while attempt 1's processes live, and says which."""
    run = tree_run(tmp_path)
    sup = start_supervisor(run)
    pids.runs.append((run, sup))
    in_group = pids.read(tmp_path / "group.1.pid")
    left_group = pids.read(tmp_path / "setsid.1.pid")
    kill_launcher(run, pids)
    wait_for(lambda: "launcher lost" in (stage_state(run, "train").get("reason") or ""), 10, "followed")
    write_json(run.stage("train").attempt_file, {"attempt": 2, "t": time.time()})
    reason = wait_for(
        lambda: (
            "cannot start attempt 2" in (stage_state(run, "train").get("reason") or "")
            and stage_state(run, "train")["reason"]
        ),
        10,
        "the launch to be refused",
    )
    assert states(run)["train"] == "pending"
    assert str(left_group) in str(reason) and "kill it first" in str(reason)
    time.sleep(0.5)
    assert (tmp_path / "starts.log").read_text().split() == ["1"]
    (tmp_path / "release").touch()
    wait_for(lambda: not pid_alive(in_group) and not pid_alive(left_group), 10, "attempt 1 to end")
    pids.read(tmp_path / "group.2.pid")  # then attempt 2 starts
    assert wait_done(run) == {"train": "succeeded"}
    assert (tmp_path / "starts.log").read_text().split() == ["1", "2"]


LEAVES = r"""
d=$1
setsid sh -c 'trap "" TERM; echo $$ > "$0/left.pid"; while :; do sleep 0.1; done' "$d" &
while [ ! -s "$d/left.pid" ]; do sleep 0.05; done
"""
# The dependant: is the left-behind process still running (a zombie waiting for init to reap it is not)?
NEXT = r"""
s=$(cut -d' ' -f3 "/proc/$(cat "$1/left.pid")/stat" 2>/dev/null)
case "$s" in ''|Z|X) echo alone ;; *) echo beside ;; esac > "$1/next.out"
"""


def test_what_an_ended_attempt_left_running_is_stopped_before_its_dependants_start(
    tmp_path: Path, pids: Pids
) -> None:
    """Like a systemd unit's cgroup: the stage exits 0 leaving a setsid process that ignores SIGTERM; it is
    SIGKILLed after the kill grace, and only then does the stage count as succeeded."""
    script, nxt = tmp_path / "leaves.sh", tmp_path / "next.sh"
    script.write_text(LEAVES)
    nxt.write_text(NEXT)
    left = tmp_path / "left.pid"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "leaves"
        command = "sh {script} {tmp_path}"
        kill_grace_s = 1
        [[stage]]
        id = "next"
        command = "sh {nxt} {tmp_path}"
        after = ["leaves"]
        """,
    )
    sup = start_supervisor(run)
    pids.runs.append((run, sup))
    left_pid = pids.read(left)
    assert wait_done(run) == {"leaves": "succeeded", "next": "succeeded"}
    assert not pid_alive(left_pid)
    assert (tmp_path / "next.out").read_text().strip() == "alone"
    log = run.supervisor_log.read_text()
    assert "ended (exit 0) but left" in log and str(left_pid) in log and "SIGKILL" in log


def _stopped(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.state in ("T", "t")


@pytest.mark.parametrize("launcher", ["alive", "killed"])
def test_pause_resume_and_kill_reach_the_process_that_left_the_group(
    tmp_path: Path, pids: Pids, launcher: str
) -> None:
    """A stage with no safe point is frozen (SIGSTOP) after its pause grace: the setsid child too, whether
    its launcher lives or was killed; resume lets both run; kill ends both."""
    script = tmp_path / "tree.sh"
    script.write_text(TREE)
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "train"
        command = "sh {script} {tmp_path}"
        pause_grace_s = 0.3
        kill_grace_s = 2
        """,
    )
    sup = start_supervisor(run)
    pids.runs.append((run, sup))
    in_group = pids.read(tmp_path / "group.1.pid")
    left_group = pids.read(tmp_path / "setsid.1.pid")
    if launcher == "killed":
        kill_launcher(run, pids)
        wait_for(lambda: "launcher lost" in (stage_state(run, "train").get("reason") or ""), 10, "followed")
    assert ctl(run, "pause", "train").returncode == 0
    wait_for(lambda: states(run)["train"] == "paused", 10, "the stage to be paused")
    assert _stopped(in_group) and _stopped(left_group)
    assert ctl(run, "resume", "train").returncode == 0
    wait_for(lambda: not _stopped(in_group) and not _stopped(left_group), 10, "both to run again")
    wait_for(lambda: states(run)["train"] == "running", 10, "the stage to run again")
    assert ctl(run, "kill", "train").returncode == 0
    wait_for(lambda: not pid_alive(in_group) and not pid_alive(left_group), 10, "both to end")
    assert wait_done(run) == {"train": "killed"}
