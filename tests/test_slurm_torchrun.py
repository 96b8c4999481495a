"""A ``nodes = 2`` training stage through Slurm: ``srun`` starts one torchrun agent on each of the job's two
nodes (gloo, CPU), rendezvous at the first node, and the result equals one process on the same global batch;
likewise a 2-node tensor-parallel capture (extract) stores what one process stores.

The two nodes are two ``slurmd`` daemons on this one machine (``n1``, ``n2``, both at 127.0.0.1; see
slurm_cluster.py): Slurm allocates, launches and tracks them as two nodes, but the processes share the
machine's cores and network, so this checks Aerie's multi-node wiring, not a real interconnect.
"""

from __future__ import annotations

import json

import pytest
import slurm_cluster as cluster_mod
import torch
from slurm_cluster import SlurmCluster

from pipeline.run.hosts.slurm import commands as slurm
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.layout import read_json
from pipeline.run.supervise.run_setup import create_run
from tests.eagle3_fixtures import (
    TEST_SECTIONS,
    assert_same_training,
    assert_stores_match,
    events,
    losses,
    run_stage,
    shared,
    write_plan,
)
from tests.runs import start_supervisor, stop, wait_done, wait_for

pytest_plugins = ["conftest_slurm"]
pytestmark = pytest.mark.slow


def test_two_node_torchrun_training_equals_one_process(
    slurm_cluster: SlurmCluster, tmp_path_factory, tmp_path
) -> None:
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    train = {**TEST_SECTIONS["train"], "steps": 3, "checkpoint_every": 3}
    # One process, no Slurm: the reference.
    one = tmp_path / "one"
    run_stage(
        "pipeline.stages.train",
        write_plan(tmp_path / "plan1.toml", **{**TEST_SECTIONS, "train": {**train, "nproc": 1}}),
        one,
        [ext, voc],
    )
    # Two nodes x one rank, as a Slurm job run by the supervisor.
    sections = {
        **TEST_SECTIONS,
        "train": {**train, "nproc": 2},
        "executor": {"kind": "slurm"},
        "slurm": {"partition": cluster_mod.PARTITION, "time": 10},
    }
    path = write_plan(tmp_path / "plan2.toml", **sections)
    path.write_text(
        path.read_text() + '\n[[stage]]\nid = "train"\nrun = "train"\nnodes = 2\n'
        f"args = {json.dumps(['--input', str(ext), '--input', str(voc)])}\n"
    )
    run = create_run(plan_mod.load(path), tmp_path / "run")
    sup = start_supervisor(run)
    try:
        states = wait_done(run, 600)
    finally:
        stop(sup)
    sd = run.stage("train")
    assert states == {"train": "succeeded"}, sd.log.read_text()[-3000:]
    job_id = read_json(sd.slurm_job)["job_id"]
    wait_for(lambda: slurm.query(job_id).state == "COMPLETED", 30, "Slurm closing the job")
    assert slurm.hostnames(slurm.query(job_id).nodes) == ["n1", "n2"]
    two = sd.out
    ev2 = read_all(sd.events)
    s1 = torch.load(one / "checkpoints" / "step_00000003" / "training_state.pt", weights_only=False)
    s2 = torch.load(two / "checkpoints" / "step_00000003" / "training_state.pt", weights_only=False)
    assert s1["world_size"] == 1 and s2["world_size"] == 2
    assert_same_training((losses(events(one)), s1), (losses(ev2), s2))
    texts = [e.get("text", "") for e in ev2 if e.type == "message"]
    assert any("2 nodes x 1 ranks under torchrun" in t for t in texts), texts


def test_two_node_tensor_parallel_capture_equals_one_process(slurm_cluster: SlurmCluster, tmp_path) -> None:
    """``extract`` with ``nodes = 2`` and the target tensor-parallel over 2 ranks (one per node, gloo) stores
    what one process stores, within one bf16 step (the all-reduce sums partial products in another order;
    see test_kimi's single-node version of this check)."""
    import os
    import subprocess
    import sys

    from tests.kimi_fixture import build_tiny_kimi
    from tests.runs import ROOT
    from tests.test_kimi import _extract, _plan

    model = build_tiny_kimi(tmp_path / "kimi")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    prep = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.stages.prep",
            "--plan",
            str(_plan(tmp_path, model)),
            "--dataset",
            "kimi",
            "--out",
            str(tmp_path / "tok"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    (tmp_path / "one").mkdir()
    _extract(_plan(tmp_path / "one", model, 'device = "cpu"'), tmp_path / "ext1", [tmp_path / "tok"])
    (tmp_path / "two").mkdir()
    text = _plan(tmp_path / "two", model, 'parallel = "tp"\ntp_size = 2\ndevice = "cpu"').read_text()
    text = text.replace(
        "[target]",
        f'[executor]\nkind = "slurm"\n[slurm]\npartition = "{cluster_mod.PARTITION}"\ntime = 15\n\n[target]',
        1,
    )
    text = text[: text.index("[[stage]]")] + (
        f'[[stage]]\nid = "extract"\nrun = "extract"\nnodes = 2\n'
        f"args = {json.dumps(['--input', str(tmp_path / 'tok')])}\n"
    )
    path = tmp_path / "two" / "slurm.toml"
    path.write_text(text)
    run = create_run(plan_mod.load(path), tmp_path / "two" / "run")
    sup = start_supervisor(run)
    try:
        states = wait_done(run, 600)
    finally:
        stop(sup)
    sd = run.stage("extract")
    assert states == {"extract": "succeeded"}, sd.log.read_text()[-3000:]
    assert slurm.hostnames(slurm.query(read_json(sd.slurm_job)["job_id"]).nodes) == ["n1", "n2"]
    assert_stores_match(tmp_path / "ext1", sd.out)
    texts = [e.get("text", "") for e in read_all(sd.events) if e.type == "message"]
    assert any("2 nodes x 1 ranks under torchrun" in t for t in texts), texts
    assert any("loaded tensor-parallel over 2 ranks" in t for t in texts), texts
