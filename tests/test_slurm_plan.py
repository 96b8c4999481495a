"""Slurm plans: ``[executor] kind = "slurm"``, ``[slurm]``, per-stage ``nodes`` and ``slurm = {...}``;
every mistake is refused naming the file and the key, and the sbatch options follow the plan; a service
with ``replicas = N`` is N stages (N server jobs) whose endpoints name their nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.run.hosts.slurm.commands import sbatch_options
from pipeline.run.plan import dag as plan_mod
from tests.runs import write_plan

BASE = """
[run]
name = "t"
dir = "run"
[executor]
kind = "slurm"
[slurm]
partition = "gpu"
account = "team"
time = "4:00:00"
extra = ["--constraint=h100"]
"""


def load(tmp_path: Path, body: str) -> plan_mod.Plan:
    return plan_mod.load(write_plan(tmp_path, body))


def error(tmp_path: Path, body: str) -> str:
    with pytest.raises(plan_mod.PlanError) as exc:
        load(tmp_path, body)
    return str(exc.value)


def test_stage_resources_map_to_sbatch_options_with_stage_overrides(tmp_path: Path) -> None:
    plan = load(
        tmp_path,
        BASE
        + """
[[stage]]
id = "train"
command = "true"
cpu = 16
gpus = 8
nodes = 2
slurm = { partition = "big", time = 600, extra = ["--exclusive"] }
[[stage]]
id = "prep"
command = "true"
""",
    )
    train, prep = plan.stage("train"), plan.stage("prep")
    assert (train.nodes, len(train.gpus), train.cpu) == (2, 8, 16)
    opts = sbatch_options(plan.settings.slurm, train)
    assert "--nodes=2" in opts and "--cpus-per-task=16" in opts and "--gpus-per-node=8" in opts
    assert "--partition=big" in opts and "--account=team" in opts and "--time=600" in opts
    assert opts[-2:] == ["--constraint=h100", "--exclusive"]
    opts = sbatch_options(plan.settings.slurm, prep)
    assert "--partition=gpu" in opts and "--time=4:00:00" in opts and "--nodes=1" in opts
    assert not any(o.startswith("--gpus-per-node") for o in opts)
    # The spec a run dir freezes keeps both.
    again = plan_mod.StageSpec.from_dict(train.to_dict())
    assert (again.nodes, again.slurm) == (2, train.slurm)


@pytest.mark.parametrize(
    ("body", "key", "words"),
    [
        (
            '[executor]\nkind = "local"\n[[stage]]\nid = "a"\ncommand = "true"\nnodes = 2\n',
            "stage[0].nodes",
            'needs executor.kind = "slurm"',
        ),
        ('[executor]\nkind = "local"\n[slurm]\npartition = "x"\n', "slurm", "needs executor.kind"),
        ('[executor]\nkind = "slurm"\n[slurm]\npartiton = "x"\n', "slurm.partiton", "unknown key"),
        ('[executor]\nkind = "slurm"\n[slurm]\npartition = "a b"\n', "slurm.partition", "not a valid"),
        ('[executor]\nkind = "slurm"\n[slurm]\ntime = "soon"\n', "slurm.time", "not a Slurm time limit"),
        (
            '[executor]\nkind = "slurm"\n[slurm]\nextra = ["; rm -rf /"]\n',
            "slurm.extra[0]",
            "sbatch long option",
        ),
        (
            '[executor]\nkind = "slurm"\n[[stage]]\nid = "a"\ncommand = "true"\nnodes = 0\n',
            "stage[0].nodes",
            "out of range",
        ),
        (
            '[executor]\nkind = "slurm"\n[[stage]]\nid = "a"\ncommand = "true"\nslurm = { qos = "-x" }\n',
            "stage[0].slurm.qos",
            "not a valid",
        ),
        ('[executor]\nkind = "slurm"\nhost = "login1"\n', "executor.remote_dir", "shared filesystem"),
    ],
)
def test_mistakes_name_the_file_and_key(tmp_path: Path, body: str, key: str, words: str) -> None:
    msg = error(tmp_path, '[run]\ndir = "run"\n' + body)
    assert str(tmp_path / "plan.toml") in msg and f": {key}: " in msg and words in msg


def test_a_replicated_service_is_one_stage_per_server_job_and_uses_means_all(tmp_path: Path) -> None:
    plan = load(
        tmp_path,
        BASE
        + """
[[stage]]
id = "serve"
run = "serve"
service = true
replicas = 3
gpus = 8
[[stage]]
id = "regen"
command = "true"
uses = ["serve"]
[[stage]]
id = "extract"
command = "true"
after = ["regen", "serve"]
""",
    )
    assert [s.id for s in plan.stages if s.family == "serve"] == ["serve.r1", "serve.r2", "serve.r3"]
    assert plan.stage("regen").uses == ("serve.r1", "serve.r2", "serve.r3")
    assert plan.stage("extract").after == ("regen", "serve.r1", "serve.r2", "serve.r3")
    msg = error(tmp_path, BASE + '[[stage]]\nid = "s"\ncommand = "true"\nreplicas = 2\n')
    assert ": stage[0].replicas: " in msg and "needs a service stage" in msg


def test_a_server_listening_everywhere_under_slurm_advertises_its_node(tmp_path: Path, monkeypatch) -> None:
    """A replica's endpoint.json names its node, so regen jobs on other nodes reach it."""
    import socket
    from types import SimpleNamespace

    from pipeline.serving.sglang_args import ServerSettings
    from pipeline.stages.serve.stage import ServeStage

    stage = ServeStage(
        SimpleNamespace(out=tmp_path),
        ServerSettings(backend="local", model="m", host="0.0.0.0", port=31234),
        5.0,
    )  # type: ignore[arg-type]
    monkeypatch.delenv("AERIE_EXECUTOR", raising=False)
    assert stage.advertised_url() == "http://0.0.0.0:31234"
    monkeypatch.setenv("AERIE_EXECUTOR", "slurm")
    assert stage.advertised_url() == f"http://{socket.gethostname()}:31234"
    local = ServeStage(SimpleNamespace(out=tmp_path), ServerSettings(backend="local", model="m"), 5.0)  # type: ignore[arg-type]
    assert local.advertised_url() == "http://127.0.0.1:30000"


def test_the_example_slurm_plan_is_valid_and_spreads_capture_and_training_over_two_nodes() -> None:
    from tests.runs import ROOT

    plan = plan_mod.load(ROOT / "examples" / "kimi-k2.5-slurm.toml")
    assert plan.executor.kind == "slurm" and plan.executor.host
    assert (plan.stage("extract").nodes, plan.stage("train").nodes) == (2, 2)
    assert plan.settings.train.nproc == 16 and plan.settings.extract.tp_size == 16
    assert plan.stage("regen.ultrachat").uses == ("serve.r1", "serve.r2")
    opts = sbatch_options(plan.settings.slurm, plan.stage("train"))
    assert {"--nodes=2", "--gpus-per-node=8", "--time=4-00:00:00", "--exclusive"} <= set(opts)


def test_the_board_shows_a_job_waiting_in_slurms_queue_as_starting_with_slurms_reason() -> None:
    from console.model import StageView
    from console.widgets.board import note_for

    st = StageView(id="train", family="train")
    # the rows as the supervisor writes them to state.json: the display state is a field, not the reason's words
    reason = "queued: Slurm job 12 pending (Resources)"
    st.update_from({"state": "running", "reason": reason, "queued": True, "display": "starting"})
    assert st.display_state == "starting" and note_for(st) == "queued: Slurm job 12 pending (Resources)"
    st.update_from(
        {"state": "running", "reason": "Slurm job 12 on n[1-2]", "queued": False, "display": "running"}
    )
    assert st.display_state == "running" and not st.queued
