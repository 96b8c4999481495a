"""Disk budget and GPU guard: projection maths, refusals with real statvfs, --force, foreign GPU holders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.run.hosts.gpus import FakeNvmlReplay, GpuProbe
from pipeline.run.hosts.procs import ProcIdentity, read_stat
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import StageSpec
from pipeline.run.rundir.layout import RunDir, write_json
from pipeline.run.supervise import budget
from pipeline.run.supervise.supervisor import Supervisor
from tests.runs import (
    ctl,
    events,
    kill_run_stages,
    make_run,
    stage_state,
    start_supervisor,
    stop,
    wait_done,
    wait_for,
)

FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"
GiB = 1 << 30


# ------------------------------------------------------------------------------------- maths
def test_extraction_bytes_is_tokens_times_layers_times_hidden_times_dtype() -> None:
    assert budget.extraction_bytes(1000, 4, 576, 2) == 1000 * 4 * 576 * 2
    # The seed's Kimi budget: ~100K samples x ~2K tokens, 3 aux layers + last, hidden 7168, bf16.
    kimi = budget.extraction_bytes(100_000 * 2_000, 4, 7168, 2)
    assert 11e12 < kimi < 12e12  # "≈ 11–12 TB" in shared/reference/eagle3-facts.md
    with pytest.raises(ValueError, match="hidden_size"):
        budget.extraction_bytes(10, 4, -1, 2)


EXTRACT_PLAN = """
[run]
name = "b"
dir = "run"
[target]
model = "{model}"
{target}
[extract]
{extract}
[[stage]]
id = "prep"
command = "true"
for_each = "dataset"
[[stage]]
id = "extract"
run = "extract"
after = ["prep.*"]
"""


def _extract_setup(
    tmp_path: Path, extract: str = "", model: str = "x/none", target: str = "hidden_size = 576"
) -> tuple[plan_mod.Plan, RunDir, StageSpec]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ds = "".join(
        f'[[datasets]]\nname = "{n}"\nsource = "s"\nkind = "target-native"\nquota = 10\n' for n in "abc"
    )
    run = make_run(tmp_path, EXTRACT_PLAN.format(model=model, target=target, extract=extract) + ds)
    plan = plan_mod.load(run.plan_path, run_dir=run.root)
    return plan, run, plan.stage("extract")


def _manifests(run: RunDir) -> None:
    write_json(
        run.stage("prep.a").out / "manifest.json",
        {"kind": "tokenized", "rows": 9, "tokens": 1200, "shards": []},
    )
    for shard, tok in (("s0", 300), ("s1", 500)):  # per-folder manifests are summed too
        write_json(
            run.stage("prep.b").out / shard / "manifest.json",
            {"kind": "tokenized", "rows": 3, "tokens": tok, "shards": []},
        )
    write_json(
        run.stage("prep.c").out / "manifest.json", {"kind": "prompts", "rows": 40}
    )  # nothing to extract


def test_extraction_projection_reads_prep_manifests_and_the_plan(tmp_path: Path) -> None:
    plan, run, spec = _extract_setup(tmp_path, "aux_layers = [1, 14, 26]")
    assert budget.projected_bytes(spec, plan, run) is None  # prep has not written its manifests yet
    _manifests(run)
    proj = budget.projected_bytes(spec, plan, run)
    assert proj is not None
    assert proj.bytes == budget.extraction_bytes(2000, 3 + 1, 576, 2) + 2000 * 9
    assert "2,000 tokens x 4 layers x hidden 576" in proj.how
    # The same bytes per token as the extraction stage's own store.
    from pipeline.eagle3 import hidden_store

    assert proj.bytes == 2000 * hidden_store.bytes_per_token(576, 3)


def test_caps_online_mode_and_the_stage_own_projection(tmp_path: Path) -> None:
    plan, run, spec = _extract_setup(tmp_path / "cap", "max_tokens = 1000")
    _manifests(run)
    assert budget.projected_bytes(spec, plan, run).bytes == 1000 * (4 * 576 * 2 + 9)
    plan2, run2, spec2 = _extract_setup(tmp_path / "online", 'mode = "online"')
    _manifests(run2)
    assert budget.projected_bytes(spec2, plan2, run2).bytes == 0
    # Once the stage runs, what it reports (held-out rows excluded) replaces the estimate.
    plan3, run3, spec3 = _extract_setup(tmp_path / "emitted")
    _manifests(run3)
    from pipeline.run.rundir.events import EventWriter

    with EventWriter(run3.stage("extract").events) as w:
        w.emit("started", attempt=1, pid=1)
        w.emit("metric", name="projected_bytes", value=1234567, tokens=1900)
    proj = budget.projected_bytes(spec3, plan3, run3)
    assert proj.bytes == 1234567 and "reported by the stage" in proj.how


def test_hidden_size_comes_from_the_target_config(tmp_path: Path) -> None:
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    plan, run, spec = _extract_setup(tmp_path / "p", model=str(model), target="")
    _manifests(run)
    assert budget.projected_bytes(spec, plan, run).bytes == 2000 * (4 * 7168 * 2 + 9)
    plan2, run2, spec2 = _extract_setup(tmp_path / "unknown", target="")  # no config anywhere: cannot project
    _manifests(run2)
    assert budget.projected_bytes(spec2, plan2, run2) is None


def test_a_bad_manifest_is_named_in_the_error(tmp_path: Path) -> None:
    plan, run, spec = _extract_setup(tmp_path)
    write_json(
        run.stage("prep.a").out / "manifest.json", {"kind": "tokenized", "tokens": "lots", "shards": []}
    )
    with pytest.raises(budget.BudgetError, match=r"prep\.a/out/manifest\.json: tokens: expected an integer"):
        budget.projected_bytes(spec, plan, run)


def test_declared_output_bytes_win_and_written_bytes_are_subtracted(tmp_path: Path) -> None:
    run = make_run(
        tmp_path, '[run]\nname="b"\ndir="run"\n[[stage]]\nid="x"\ncommand="true"\noutput_bytes=1000000\n'
    )
    plan = plan_mod.load(run.plan_path, run_dir=run.root)
    spec = plan.stage("x")
    assert budget.projected_bytes(spec, plan, run).bytes == 1_000_000
    (run.stage("x").out).mkdir(parents=True, exist_ok=True)
    (run.stage("x").out / "part").write_bytes(os.urandom(256 * 1024))  # a resumed stage's partial output
    need, _ = budget.remaining_bytes(spec, plan, run)
    assert 1_000_000 - 300 * 1024 < need <= 1_000_000 - 256 * 1024


# --------------------------------------------------------------------------- disk refusals
def _free(path: Path) -> int:
    return budget.disk_free(path)[2]


def test_refused_for_disk_budget_then_allowed_with_force(tmp_path: Path) -> None:
    """A real supervisor, the real filesystem: a stage projected to write twice the free space."""
    huge = 2 * _free(tmp_path) + (1 << 40)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "budget"
        dir = "run"
        [[stage]]
        id = "small"
        command = "echo small > out.txt"
        output_bytes = 4096
        [[stage]]
        id = "huge"
        command = "echo wrote > out.txt"
        output_bytes = {huge}
        """,
    )
    sup = start_supervisor(run)
    try:
        reason = wait_for(
            lambda: (
                "disk budget" in stage_state(run, "huge").get("reason", "")
                and stage_state(run, "huge")["reason"]
            ),
            30,
            "the disk-budget refusal",
        )
        assert stage_state(run, "huge")["state"] == "pending"
        assert (
            "huge needs" in reason and "free minus a 953.7 MiB reserve" in reason and "force huge" in reason
        )
        wait_for(lambda: stage_state(run, "small").get("state") == "succeeded", 30, "the small stage")
        assert not run.stage("huge").launch.exists()  # never started
        res = ctl(run, "force", "huge")
        assert res.returncode == 0, res.stderr
        assert wait_done(run)["huge"] == "succeeded"
        assert (run.stage("huge").out / "out.txt").read_text() == "wrote\n"
        forced = [e for e in events(run, "huge", "message") if e.get("code") == "forced"]
        assert len(forced) == 1 and forced[0].get("level") == "warning"
    finally:
        stop(sup)
        kill_run_stages(run)


def test_reserve_and_running_stages_count_against_free_space(tmp_path: Path) -> None:
    free = _free(tmp_path)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "r"
        dir = "run"
        [resources]
        disk_reserve_gb = {(free // 2) / 1e9}
        [[stage]]
        id = "a"
        command = "true"
        output_bytes = {free // 3}
        [[stage]]
        id = "b"
        command = "true"
        output_bytes = {free // 3}
        """,
    )
    s = Supervisor(run)
    s.refresh()
    # Alone, a third of the free space fits beside a reserve of half of it...
    assert budget.disk_budget_check(s.specs["a"], s) is None
    # ...but not while another stage is still to write its own third.
    s.status["b"] = replace(s.status["b"], state="running")
    why = budget.disk_budget_check(s.specs["a"], s)
    assert why and "still to be written by running stages" in why
    # A plan reserve that is not a number is a clear refusal when the plan loads, not a supervisor crash.
    (tmp_path / "bad").mkdir()
    with pytest.raises(
        plan_mod.PlanError, match=r"plan\.toml: resources\.disk_reserve_gb: expected a number"
    ):
        make_run(
            tmp_path / "bad",
            '[run]\nname="r"\ndir="run"\n[resources]\ndisk_reserve_gb="lots"\n'
            '[[stage]]\nid="a"\ncommand="true"\noutput_bytes=10\n',
        )


# -------------------------------------------------------------------------------- GPU guard
def _replay(tmp_path: Path, pid: int | None, seq: int = 1) -> FakeNvmlReplay:
    """The recorded H200 sample ``seq``, its process replaced by ``pid`` (or none)."""
    recs = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    out = [r for r in recs if r["kind"] == "meta"]
    g = next(r for r in recs if r["kind"] == "gpu" and r["seq"] == seq)
    g = dict(g, procs=[dict(p, pid=pid) for p in g["procs"]][:1] if pid else [])
    path = tmp_path / f"replay-{pid}-{seq}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*out, g]) + "\n")
    return FakeNvmlReplay(path)


GPU_PLAN = """
[run]
name = "g"
dir = "run"
[resources]
gpus = [0, 1]
[[stage]]
id = "serve"
command = "sleep 30"
service = true
[[stage]]
id = "train"
command = "echo trained > out.txt"
gpus = [0]
[[stage]]
id = "other"
command = "true"
gpus = [1]
"""


def test_gpu_guard_names_the_foreign_pid_and_gpu_then_force_starts_it(tmp_path: Path) -> None:
    run = make_run(tmp_path, GPU_PLAN)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not an Aerie stage
    try:
        probe = GpuProbe(_replay(tmp_path, holder.pid), ttl_s=0)

        def guard(spec: StageSpec, sup: Supervisor) -> str | None:
            return budget.gpu_guard_check(spec, sup, probe=probe)

        s = Supervisor(run, admission=[guard])
        s.acquire_lock()
        s.tick()  # starts serve and other (GPU 1); train is refused
        s.tick()
        train = s.status["train"]
        assert train.state == "pending"
        assert train.reason.startswith(f"GPU guard: GPU 0 held by foreign pid {holder.pid} (python")
        assert "2.6 GiB" in train.reason and "force train" in train.reason
        assert not run.stage("train").launch.exists()
        assert s.status["other"].state == "running"  # GPU 1 is free in the recording
        s.handle_requests()
        assert "admission checks overridden" in s.do_force("train")
        s.tick()
        assert run.stage("train").launch.exists()
        wait_for(lambda: (s.tick() or s.status["train"].state) == "succeeded", 30, "train under --force")
        assert any(e.get("code") == "forced" for e in events(run, "train", "message"))
    finally:
        holder.kill()
        holder.wait()
        kill_run_stages(run)


def test_gpu_guard_names_the_stage_that_still_holds_a_gpu(tmp_path: Path) -> None:
    """A process in a stage's recorded process group is that stage's, not foreign."""
    run = make_run(tmp_path, GPU_PLAN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        st = read_stat(child.pid)
        assert st is not None
        ident = ProcIdentity(child.pid, st.pgid, st.start_time, "")
        write_json(run.stage("serve").proc, {"attempt": 1, **ident.to_dict(), "t": 0})
        probe = GpuProbe(_replay(tmp_path, child.pid), ttl_s=0)
        s = Supervisor(run)
        s.refresh()
        why = budget.gpu_guard_check(s.specs["train"], s, probe=probe)
        assert why and f"GPU 0 held by pid {child.pid} of stage serve" in why
        idle = GpuProbe(_replay(tmp_path, None, seq=11), ttl_s=0)  # the recorded free GPU
        assert budget.gpu_guard_check(s.specs["train"], s, probe=idle) is None
    finally:
        child.kill()
        child.wait()


def test_gpu_guard_without_a_driver_cannot_refuse(tmp_path: Path) -> None:
    run = make_run(tmp_path, GPU_PLAN)
    s = Supervisor(run)
    s.refresh()
    probe = GpuProbe(ttl_s=0)  # the real NVML: this machine has no driver
    assert budget.gpu_guard_check(s.specs["train"], s, probe=probe) is None
    assert probe.unavailable and "no NVIDIA driver" in probe.unavailable
