"""With job accounting (slurmdbd on a private MariaDB), as production clusters keep it: once slurmctld has
forgotten an ended job (``MinJobAge``), its state, exit code and name come from ``sacct`` — a supervisor
re-attaching after that still finds the job it submitted, and says how it ended."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as cluster_mod
from slurm_cluster import SlurmCluster

from pipeline.run.hosts.slurm import commands as slurm
from pipeline.run.hosts.slurm.jobs import batch_script
from pipeline.run.rundir.layout import read_json, write_json
from tests.runs import make_run, stage_state, start_supervisor, states, stop, wait_done, wait_for

pytest_plugins = ["conftest_slurm"]
pytestmark = pytest.mark.slow

HEAD = f"""
[run]
name = "sacct-test"
dir = "run"
[executor]
kind = "slurm"
[slurm]
partition = "{cluster_mod.PARTITION}"
"""


def forgotten_by_slurmctld(job: str) -> bool:
    p = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    return p.returncode != 0 and "invalid job id" in (p.stdout + p.stderr).lower()


def in_sacct(job: str, state: str) -> bool:
    out = subprocess.run(
        ["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job}", "--format=State"],
        capture_output=True,
        text=True,
    ).stdout
    return out.strip().startswith(state)


def test_a_supervisor_finds_a_purged_job_by_name_and_its_exit_through_sacct(
    slurm_accounting_cluster: SlurmCluster, tmp_path: Path
) -> None:
    assert slurm.accounting()
    run = make_run(
        tmp_path,
        HEAD
        + """
[[stage]]
id = "once"
command = "echo ran >> $AERIE_OUT/runs"
[[stage]]
id = "bad"
command = "exit 3"
""",
    )
    # Both attempts were submitted by a supervisor that died before recording the job ids; both jobs ended
    # and slurmctld forgot them before a new supervisor came.
    jobs = {}
    for sid in ("once", "bad"):
        sd = run.stage(sid)
        name = f"aerie-{sid}-1-0123456789ab"
        write_json(sd.launch, {"attempt": 1, "t": time.time()})
        write_json(
            sd.slurm_job,
            {"attempt": 1, "name": name, "token": "0123456789ab", "state": "submitting", "t": time.time()},
        )
        script = sd.path / "job-1.sh"
        script.write_text(batch_script(run, sid, 1, sys.executable))
        sd.out.mkdir(parents=True, exist_ok=True)
        jobs[sid] = slurm.submit(
            script, name, "aerie:0123456789ab", sd.log, sd.out, [f"--partition={cluster_mod.PARTITION}"]
        )
    sd_bad = run.stage("bad")
    for sid, job in jobs.items():
        wait_for(lambda job=job: forgotten_by_slurmctld(job), 150, f"slurmctld forgetting job {job}")
        wait_for(
            lambda job=job, sid=sid: in_sacct(job, "COMPLETED" if sid == "once" else "FAILED"),
            60,
            f"sacct recording job {job}",
        )
    # The launcher of "bad" recorded its exit; remove it, as if the node died before the shared filesystem
    # had it: the supervisor then has only Slurm's word for how the job ended.
    sd_bad.exit.unlink()
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 120) == {"once": "succeeded", "bad": "failed"}
    finally:
        stop(sup)
    for sid, job in jobs.items():
        rec = read_json(run.stage(sid).slurm_job)
        assert rec["job_id"] == job and rec.get("found_by_name")
    assert (run.stage("once").out / "runs").read_text() == "ran\n"  # submitted once, run once
    info = slurm.query(jobs["bad"])
    assert (info.state, info.exit_code) == ("FAILED", 3)
    assert (
        "Slurm job" in stage_state(run, "bad")["reason"]
        and "FAILED (exit 3)" in stage_state(run, "bad")["reason"]
    )


def test_a_job_cancelled_outside_aerie_says_so_from_sacct(
    slurm_accounting_cluster: SlurmCluster, tmp_path: Path
) -> None:
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
        job = str(
            wait_for(lambda: (read_json(run.stage("victim").slurm_job) or {}).get("job_id"), 30, "job id")
        )
        wait_for(lambda: read_json(run.stage("victim").proc), 60, "the launcher started")
        subprocess.run(["scancel", job], check=True)
        wait_for(lambda: states(run).get("victim") == "failed", 60, "victim failed")
        wait_for(lambda: "CANCELLED outside Aerie" in stage_state(run, "victim")["reason"], 30, "the reason")
    finally:
        stop(sup)
    assert slurm.query(job).state == "CANCELLED"
