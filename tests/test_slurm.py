"""The Slurm executor against a real Slurm (slurmctld + two slurmd on this machine; see slurm_cluster.py).

Every stage attempt is a Slurm job: dependent stages run to success; kill is ``scancel`` and spares a
process of the same name outside Slurm; a supervisor SIGKILLed mid-run (even between ``sbatch`` and
writing the job id down) re-attaches without submitting again; a job Slurm rejects fails the stage
with Slurm's message; a job cancelled outside Aerie says so; pause falls back to ``scontrol suspend``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as cluster_mod
from slurm_cluster import SlurmCluster

from console.model import RunModel
from console.transport import LocalTransport
from console.widgets.board import note_for
from pipeline.run.hosts.slurm import commands as slurm
from pipeline.run.hosts.slurm.jobs import batch_script
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from tests.runs import (
    ctl,
    events,
    make_run,
    pid_alive,
    stage_state,
    start_supervisor,
    states,
    stop,
    wait_done,
    wait_for,
)

pytest_plugins = ["conftest_slurm"]
pytestmark = pytest.mark.slow

HEAD = f"""
[run]
name = "slurm-test"
dir = "run"
[executor]
kind = "slurm"
[slurm]
partition = "{cluster_mod.PARTITION}"
time = 10
"""


def jobs_named(prefix: str) -> list[tuple[str, str, str]]:
    """(job id, name, state) of every job this cluster knows whose name starts with ``prefix``."""
    out = subprocess.run(
        ["squeue", "--noheader", "--states=all", "--format=%i|%j|%T"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
    return [r for r in rows if r[1].startswith(prefix)]  # type: ignore[misc]


def job_of(run: RunDir, sid: str) -> str:
    rec = wait_for(lambda: (read_json(run.stage(sid).slurm_job) or {}).get("job_id"), 30, f"{sid}'s job id")
    return str(rec)


def test_dependent_stages_run_to_success_as_slurm_jobs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "make"
command = "echo $SLURM_JOB_ID > $AERIE_OUT/job; echo 21 > $AERIE_OUT/n"
cpu = 2
[[stage]]
id = "double"
command = "echo $SLURM_JOB_ID > $AERIE_OUT/job; echo $(( $(cat ../../make/out/n) * 2 )) > $AERIE_OUT/n"
after = ["make"]
[[stage]]
id = "report"
command = "echo $SLURM_JOB_ID > $AERIE_OUT/job; test $(cat ../../double/out/n) = 42"
after = ["double"]
""",
    )
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 120) == {"make": "succeeded", "double": "succeeded", "report": "succeeded"}
    finally:
        stop(sup)
    seen = set()
    for sid in ("make", "double", "report"):
        rec = read_json(run.stage(sid).slurm_job)
        # The job that ran the stage is the one recorded, and Slurm says it completed.
        assert (run.stage(sid).out / "job").read_text().strip() == rec["job_id"]
        # (the stage is done when its launcher recorded the exit; Slurm closes the job a moment later)
        wait_for(lambda rec=rec: slurm.query(rec["job_id"]).state == "COMPLETED", 30, "the job completed")
        seen.add(rec["job_id"])
    assert len(seen) == 3
    # One squeue call answers for many jobs, and leaves out one Slurm does not know.
    assert {j: i.state for j, i in slurm.states([*sorted(seen), "999999"]).items()} == dict.fromkeys(
        seen, "COMPLETED"
    )
    assert (run.stage("double").out / "n").read_text().strip() == "42"
    # `aerie status --json` names each stage's job.
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = {
        d["id"]: d.get("job") for d in map(json.loads, out.splitlines()) if "id" in d
    }  # not the projection
    assert jobs == {
        sid: read_json(run.stage(sid).slurm_job)["job_id"] for sid in ("make", "double", "report")
    }
    # The resources went to Slurm: 2 CPUs for "make".
    out = subprocess.run(
        ["scontrol", "show", "job", read_json(run.stage("make").slurm_job)["job_id"]],
        capture_output=True,
        text=True,
    ).stdout
    assert "NumCPUs=2" in out


def test_kill_is_scancel_and_spares_a_same_named_process_outside_slurm(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    bystander = subprocess.Popen(["sleep", "4321"], start_new_session=True)
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "long"
command = "sleep 4321"
kill_grace_s = 5
""",
    )
    sup = start_supervisor(run)
    try:
        job = job_of(run, "long")
        wait_for(
            lambda: slurm.query(job).state == "RUNNING" and read_json(run.stage("long").proc),
            60,
            "the job running",
        )
        launcher_pid = read_json(run.stage("long").proc)["pid"]
        r = ctl(run, "kill", "long")
        assert r.returncode == 0 and f"scancel sent to Slurm job {job}" in r.stdout
        wait_for(lambda: states(run).get("long") == "killed", 60, "long killed")
        assert slurm.query(job).state == "CANCELLED"
        assert not pid_alive(launcher_pid)
        assert bystander.poll() is None, "a process outside Slurm with the same command was touched"
    finally:
        stop(sup)
        bystander.kill()
        bystander.wait()


def test_a_supervisor_sigkilled_mid_run_reattaches_without_resubmitting(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "slow"
command = "sleep 6; echo finished > $AERIE_OUT/done"
[[stage]]
id = "next"
command = "true"
after = ["slow"]
""",
    )
    sup = start_supervisor(run)
    job = job_of(run, "slow")
    wait_for(lambda: slurm.query(job).state == "RUNNING", 60, "the job running")
    os.kill(sup.pid, signal.SIGKILL)  # the supervisor only: the job is Slurm's, not its child
    sup.wait()
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 120) == {"slow": "succeeded", "next": "succeeded"}
    finally:
        stop(sup)
    assert [j[0] for j in jobs_named("aerie-slow-")] == [job]  # one job, the first one
    assert len(jobs_named("aerie-next-")) == 1


def test_a_supervisor_killed_between_sbatch_and_the_record_finds_the_job_by_name(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "once"
command = "echo ran >> $AERIE_OUT/runs"
""",
    )
    sd = run.stage("once")
    # What a supervisor leaves when it dies right after sbatch returned: the "submitting" record, a job.
    name = "aerie-once-1-feedfacecafe"
    write_json(sd.launch, {"attempt": 1, "t": time.time()})
    write_json(
        sd.slurm_job,
        {"attempt": 1, "name": name, "token": "feedfacecafe", "state": "submitting", "t": time.time()},
    )
    script = sd.path / "job-1.sh"
    script.write_text(batch_script(run, "once", 1, sys.executable))
    sd.out.mkdir(parents=True, exist_ok=True)
    job = slurm.submit(
        script, name, "aerie:feedfacecafe", sd.log, sd.out, [f"--partition={cluster_mod.PARTITION}"]
    )
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 120) == {"once": "succeeded"}
    finally:
        stop(sup)
    rec = read_json(sd.slurm_job)
    assert rec["job_id"] == job and rec.get("found_by_name")
    assert [j[0] for j in jobs_named("aerie-once-")] == [job]
    assert (sd.out / "runs").read_text() == "ran\n"


def test_a_job_slurm_rejects_fails_the_stage_with_slurms_message(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = make_run(
        tmp_path,
        HEAD.replace(f'partition = "{cluster_mod.PARTITION}"', 'partition = "nosuch"')
        + """
[[stage]]
id = "a"
command = "true"
[[stage]]
id = "b"
command = "true"
after = ["a"]
""",
    )
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 60) == {"a": "failed", "b": "upstream-failed"}
    finally:
        stop(sup)
    reason = stage_state(run, "a")["reason"]
    assert "Slurm rejected the job" in reason and "Invalid partition name specified" in reason
    assert "Invalid partition name specified" in run.stage("a").log.read_text()


def test_a_job_cancelled_outside_aerie_shows_as_such(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "victim"
command = "sleep 600"
""",
    )
    sup = start_supervisor(run)
    try:
        job = job_of(run, "victim")
        wait_for(lambda: read_json(run.stage("victim").proc), 60, "the launcher started")
        subprocess.run(["scancel", job], check=True)
        wait_for(lambda: states(run).get("victim") == "failed", 60, "victim failed")
        wait_for(
            lambda: "CANCELLED outside Aerie" in stage_state(run, "victim")["reason"],
            30,
            "the reason naming the cancel",
        )
    finally:
        stop(sup)


def test_pause_without_a_safe_point_suspends_the_job_and_resume_thaws_it(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "busy"
command = "for i in $(seq 1 8); do sleep 1; done"
pause_grace_s = 1
""",
    )
    sup = start_supervisor(run)
    try:
        job = job_of(run, "busy")
        wait_for(lambda: read_json(run.stage("busy").proc), 60, "the launcher started")
        r = ctl(run, "pause", "busy")
        assert r.returncode == 0 and "scontrol suspend" in r.stdout
        wait_for(lambda: states(run).get("busy") == "paused", 30, "busy paused")
        assert slurm.query(job).state == "SUSPENDED"
        assert ctl(run, "resume", "busy").returncode == 0
        wait_for(lambda: slurm.query(job).state in ("RUNNING", "COMPLETED"), 30, "the job thawed")
        assert wait_done(run, 60) == {"busy": "succeeded"}
    finally:
        stop(sup)


def test_retry_is_a_new_job_for_the_next_attempt(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "flaky"
command = "test -e $AERIE_OUT/second || { touch $AERIE_OUT/second; echo 'first try fails' >&2; exit 3; }"
retry = { max_attempts = 2, backoff_s = 0.5 }
""",
    )
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 120) == {"flaky": "succeeded"}
    finally:
        stop(sup)

    # The stage is done once the launcher recorded its exit; Slurm closes the job a moment later.
    def ended() -> list | None:
        js = jobs_named("aerie-flaky-")
        return js if {j[2] for j in js} == {"FAILED", "COMPLETED"} else None

    jobs = wait_for(ended, 30, "both jobs ended in Slurm")
    assert len(jobs) == 2
    assert [j[1].split("-")[2] for j in sorted(jobs, key=lambda j: int(j[0]))] == [
        "1",
        "2",
    ]  # attempt 1, then 2


def test_a_service_with_replicas_runs_one_job_per_replica_and_all_are_stopped(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "server"
command = "hostname > $AERIE_OUT/node; sleep 600"
service = true
replicas = 2
[[stage]]
id = "work"
command = "sleep 4"
""",
    )
    sup = start_supervisor(run)
    try:
        jobs = [job_of(run, f"server.r{k}") for k in (1, 2)]
        wait_for(lambda: all(slurm.query(j).state == "RUNNING" for j in jobs), 60, "both server jobs running")
        # Once nobody needs them, the supervisor stops every replica (scancel), and they count as done.
        assert wait_done(run, 120) == {
            "server.r1": "succeeded",
            "server.r2": "succeeded",
            "work": "succeeded",
        }
    finally:
        stop(sup)
    assert len(set(jobs)) == 2 and all(slurm.query(j).state == "CANCELLED" for j in jobs)


def test_a_pause_slurm_cannot_freeze_says_so(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A job still queued cannot be suspended: the stage gets a clear "cannot freeze" message, and kill still works."""
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "hog"
command = "sleep 600"
nodes = 2
cpu = 4
[[stage]]
id = "waiter"
command = "sleep 600"
cpu = 4
pause_grace_s = 1
""",
    )
    sup = start_supervisor(run)
    try:
        waiter = job_of(run, "waiter")
        wait_for(
            lambda: (
                slurm.query(waiter).state == "PENDING"
                and "queued" in stage_state(run, "waiter").get("reason", "")
            ),
            60,
            "waiter queued behind hog",
        )
        # the snapshot says so in fields (the board shows it as starting, never from the reason's words)
        row = stage_state(run, "waiter")
        assert row["queued"] is True and row["display"] == "starting", row
        board = RunModel(LocalTransport(str(run.root)), backfill=False)
        asyncio.run(board.poll())
        waiter_view = board.stages["waiter"]
        assert waiter_view.display_state == "starting" and note_for(waiter_view).startswith(
            "queued: Slurm job"
        )
        assert ctl(run, "pause", "waiter").returncode == 0
        msg = wait_for(
            lambda: next(
                (e.get("text") for e in events(run, "waiter", "message") if e.get("code") == "cannot_freeze"),
                None,
            ),
            30,
            "the cannot-freeze message",
        )
        assert (
            "cannot freeze this stage: Slurm refused to suspend its job" in msg and "pending" in msg.lower()
        )
        for sid in ("waiter", "hog"):
            assert ctl(run, "kill", sid).returncode == 0
        assert wait_done(run, 60) == {"hog": "killed", "waiter": "killed"}
    finally:
        stop(sup)


def test_a_job_preempted_by_slurm_shows_as_such(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "low"
command = "sleep 600"
nodes = 2
cpu = 4
""",
    )
    sup = start_supervisor(run)
    urgent = None
    try:
        job = job_of(run, "low")
        wait_for(lambda: read_json(run.stage("low").proc), 60, "the launcher started")
        # Someone's job in a higher-priority partition needs every CPU: Slurm pre-empts ours.
        urgent = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--partition={cluster_mod.URGENT}",
                "--nodes=2",
                "--cpus-per-task=4",
                "--output=/dev/null",
                "--wrap",
                "sleep 1",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        wait_for(lambda: states(run).get("low") == "failed", 90, "low failed")
        wait_for(lambda: "PREEMPTED" in stage_state(run, "low").get("reason", ""), 30, "the reason naming it")
        assert slurm.query(job).state == "PREEMPTED"
    finally:
        stop(sup)
        if urgent:
            subprocess.run(["scancel", urgent], capture_output=True)


def test_an_sbatch_that_gets_no_answer_is_never_submitted_twice(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld frozen while the supervisor submits: sbatch times out, but the request may still be served
    once slurmctld wakes. The stage keeps its 'submitting' record and finds the job by name (or, if Slurm
    never created it, submits once more): exactly one job runs."""
    ctld = next(p for p in slurm_cluster._procs if Path(p.args[0]).name == "slurmctld")
    monkeypatch.setenv("AERIE_SLURM_TIMEOUT_S", "3")
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "frozen"
command = "echo ran >> $AERIE_OUT/runs"
""",
    )
    ctld.send_signal(signal.SIGSTOP)  # a daemon this test's cluster started, by its pid
    try:
        sup = start_supervisor(run)
        wait_for(
            lambda: run.supervisor_log.exists() and "did not answer" in run.supervisor_log.read_text(),
            30,
            "sbatch timing out",
        )
        assert (read_json(run.stage("frozen").slurm_job) or {}).get("state") == "submitting"
    finally:
        ctld.send_signal(signal.SIGCONT)
    try:
        assert wait_done(run, 120) == {"frozen": "succeeded"}
    finally:
        stop(sup)
    assert len(jobs_named("aerie-frozen-")) == 1
    assert (run.stage("frozen").out / "runs").read_text() == "ran\n"
