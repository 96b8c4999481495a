"""``aerie preflight`` on a Slurm plan, against the tests' real Slurm: partition, nodes, CPUs and GPUs from
``sinfo``, and a probe job that finds the run directory shared and the stages' imports on a compute node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster as cluster_mod
from slurm_cluster import SlurmCluster

from pipeline.run.hosts.slurm.preflight import gres_gpus
from tests.runs import ROOT, write_plan

pytest_plugins = ["conftest_slurm"]


def preflight(plan: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "console.cli", "preflight", str(plan)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def plan_text(partition: str, stage: str) -> str:
    return f"""
[run]
dir = "run"
[executor]
kind = "slurm"
[slurm]
partition = "{partition}"
[[stage]]
id = "train"
run = "train"
{stage}
[[stage]]
id = "prep"
command = "true"
"""


def test_gres_strings_give_gpus_per_node() -> None:
    assert gres_gpus("gpu:8") == 8
    assert gres_gpus("gpu:h100:4(S:0-1)") == 4
    assert gres_gpus("shard:4,gpu:a100:2") == 2
    assert gres_gpus("(null)") == 0


@pytest.mark.slow
def test_preflight_passes_on_a_plan_the_cluster_can_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    p = preflight(write_plan(tmp_path, plan_text(cluster_mod.PARTITION, "nodes = 2\ncpu = 2")))
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert f"partition '{cluster_mod.PARTITION}': 2 node(s); the largest stage (train) needs 2" in out
    assert f"run directory {tmp_path / 'run'} is shared with compute node n" in out
    assert "pipeline imports; torch" in out and "transformers" in out
    assert "ready: the run can start" in out
    assert not list((tmp_path / "run").glob(".aerie-preflight-*"))  # the probe cleans up after itself


@pytest.mark.slow
def test_preflight_names_what_the_cluster_cannot_give(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    p = preflight(write_plan(tmp_path, plan_text(cluster_mod.PARTITION, "nodes = 3\ngpus = 1")))
    assert p.returncode == 2
    assert "FAIL  partition 'debug': 2 node(s); the largest stage (train) needs 3" in p.stdout
    assert "FAIL  partition 'debug': 0 GPU(s) per node; train asks 1 per node" in p.stdout
    p = preflight(write_plan(tmp_path, plan_text("nosuch", "")))
    assert p.returncode == 2 and "FAIL  partition 'nosuch' does not exist" in p.stdout


@pytest.mark.slow
def test_preflight_checks_sglang_on_the_compute_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A plan that captures through SGLang: the node's interpreter's SGLang against the tested-versions table,
    the same verdict the local and SSH preflights give (this interpreter is the node's here)."""
    from pipeline import tested_versions as tv

    text = plan_text(cluster_mod.PARTITION, "cpu = 1").replace(
        "[executor]", '[target]\nengine = "sglang"\n[executor]'
    )
    p = preflight(write_plan(tmp_path, text))
    v = tv.classify_sglang(["capture"])
    line = next((ln for ln in p.stdout.splitlines() if " sglang " in ln and "compute node" in ln), "")
    assert v.detail in line, p.stdout + p.stderr
    assert line.lstrip().startswith(
        "FAIL" if v.level in ("absent", "refuse") else ("warn" if v.warning else "ok")
    )
    assert p.returncode == (2 if v.level in ("absent", "refuse") else 0)
