"""A Slurm plan reached over SSH: ``aerie preflight`` and ``aerie run`` connect to the login node (a loopback
sshd whose sessions see the tests' Slurm through ``SLURM_CONF``), and the supervisor there submits the stages
as Slurm jobs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import slurm_cluster as cluster_mod
from slurm_cluster import SlurmCluster
from sshd import LoopbackSshd, sshd_available
from test_ssh_cli import aerie

from pipeline.run.rundir.layout import RunDir, read_json

pytest_plugins = ["conftest_slurm"]
pytestmark = pytest.mark.slow


def test_a_slurm_plan_over_ssh_preflights_and_runs_as_jobs(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    why = sshd_available()
    if why:
        if os.environ.get("AERIE_REQUIRE_SSHD") == "1":
            pytest.fail(why)
        pytest.skip(why)
    sshd = LoopbackSshd(tmp_path / "sshd", env={"SLURM_CONF": str(slurm_cluster.conf)})
    sshd.start()
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    remote = tmp_path / "shared" / "run"
    plan = tmp_path / "plan.toml"
    plan.write_text(f"""
[run]
name = "slurm-over-ssh"
dir = "local-run"
[executor]
kind = "slurm"
host = "127.0.0.1"
port = {sshd.port}
user = "{sshd.user}"
identity = "{sshd.client_key}"
remote_dir = "{remote}"
python = "{sys.executable}"
options = {{known_hosts = "{known}", keepalive_s = 1.0}}
[slurm]
partition = "{cluster_mod.PARTITION}"
[[stage]]
id = "make"
command = "echo $SLURM_JOB_ID > f"
[[stage]]
id = "use"
after = ["make"]
command = "cat ../../make/out/f"
""")
    try:
        p = aerie("preflight", str(plan), timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "slurm" in p.stderr and "is shared with compute node n" in p.stderr
        p = aerie("run", str(plan), "--headless", "--poll", "0.2", timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        run = RunDir(remote)
        job = read_json(run.stage("make").slurm_job)["job_id"]
        assert (run.stage("make").out / "f").read_text().strip() == job
    finally:
        sshd.drop()
