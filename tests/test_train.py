"""Draft training: metrics and the finished draft, resume after a real kill, online == offline targets,
and (issue 9, CPU part) torchrun with 2 gloo processes equals one process on the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.eagle3.draft_model import load_draft
from pipeline.run.plan.sections import TrainSection
from pipeline.stages.train.settings import global_indices, lr_at
from tests.eagle3_fixtures import (
    HIDDEN,
    ROOT,
    TEST_SECTIONS,
    assert_same_training,
    events,
    losses,
    metrics,
    run_stage,
    shared,
    write_plan,
)


def test_schedule_and_data_order_are_functions_of_the_step() -> None:
    s = TrainSection(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(5, s) == pytest.approx(5e-4) and lr_at(10, s) == pytest.approx(1e-3)
    assert lr_at(100, s) == pytest.approx(1e-4)
    a = [global_indices(st, 10, 4, 0) for st in (1, 2, 3, 4)]
    assert sorted(a[0] + a[1]) != list(range(10))  # 10 // 4 = 2 batches per epoch, last 2 dropped
    assert len(set(a[0]) | set(a[1])) == 8 and a[2] != a[0]  # epoch 2 reshuffles
    assert global_indices(3, 10, 4, 0) == a[2]  # deterministic: resume needs no sampler state


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="train.batch_size"):
        TrainSection.parse({"batch_size": 3, "nproc": 2}, "p.toml")
    with pytest.raises(ValueError, match="train.stepz: unknown key"):
        TrainSection.parse({"stepz": 3}, "p.toml")
    with pytest.raises(ValueError, match="train.lr: expected a number"):
        TrainSection.parse({"lr": "fast"}, "p.toml")
    with pytest.raises(ValueError, match="train.loss_chunk_tokens: must be 0"):
        TrainSection.parse({"loss_chunk_tokens": -1}, "p.toml")
    assert TrainSection.parse({"loss_chunk_tokens": 0}, "p.toml").loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="train.stop_when_acceptance_flat: needs evaluations"):
        TrainSection.parse({"stop_when_acceptance_flat": 2, "eval_every": -1}, "p.toml")


F = False


def test_acceptance_that_stops_improving_stops_training_after_n_flat_evaluations() -> None:
    from pipeline.stages.train.plateau import Plateau

    p = Plateau(patience=2, min_delta=0.01)
    assert [p.update(s, a) for s, a in ((10, 1.5), (20, 1.8), (30, 1.805), (40, 1.7))] == [F, F, F, True]
    assert (
        p.best == 1.8
        and p.best_step == 20
        and "not improved for 2 evaluations (best 1.800 at step 20)" in (p.reason())
    )
    p = Plateau(patience=2)
    assert not any(p.update(s, a) for s, a in ((1, 1.0), (2, 0.9), (3, 1.1), (4, 1.0)))  # a new best resets
    assert not any(Plateau(patience=0).update(s, 1.0) for s in range(10))  # 0: never stops


@pytest.mark.slow
def test_training_reports_every_metric_and_writes_an_sglang_draft(tmp_path_factory) -> None:
    out = shared(tmp_path_factory, "train")
    steps = TEST_SECTIONS["train"]["steps"]
    for name in ("loss", "acc_0", "acc_1", "acc_2", "lr", "tokens_per_s"):
        assert sorted(e.get("step") for e in metrics(out, name)) == list(range(1, steps + 1)), name
    loss = losses(events(out))
    assert sum(loss[s] for s in range(steps - 3, steps + 1)) < 0.7 * sum(loss[s] for s in range(1, 5))
    acc0 = {e.get("step"): e.get("value") for e in metrics(out, "acc_0")}
    assert acc0[steps] > acc0[1]
    man = json.loads((out / "manifest.json").read_text())
    # draft/ is the checkpoint with the best simulated accept length (test_train_feed.py checks the choice)
    assert man["kind"] == "draft" and man["last_step"] == steps and man["ttt_steps"] == 3
    assert man["step"] in (12, 24)
    conf = json.loads((out / "draft" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 512
    d = load_draft(out / "draft", embed=torch.zeros(49152, HIDDEN))
    assert int(d.t2d.sum()) == 512
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_00000012", "step_00000024"]


@pytest.mark.slow
def test_training_whose_acceptance_is_flat_stops_early_and_says_so(tmp_path_factory, tmp_path) -> None:
    """lr = 0: the draft never changes, so its simulated accept length never improves; with
    ``stop_when_acceptance_flat = 2`` and an evaluation every 2 steps, training stops at step 6 of 24, checkpoints
    it, says why in the console's events and the manifest, and the draft is the best checkpoint as always."""
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    train = {**TEST_SECTIONS["train"], "lr": 0.0, "eval_every": 2, "stop_when_acceptance_flat": 2}
    plan = write_plan(tmp_path / "plan.toml", **{**TEST_SECTIONS, "train": train})
    out = tmp_path / "train"
    run_stage("pipeline.stages.train", plan, out, [ext, voc])
    man = json.loads((out / "manifest.json").read_text())
    assert man["last_step"] == 6 and man["stopped_early"].startswith("stopped early at step 6 of 24: ")
    assert "not improved for 2 evaluations" in man["stopped_early"]
    said = [e for e in events(out) if e.type == "message" and e.get("code") == "early_stop"]
    assert len(said) == 1 and said[0].get("level") == "warning"
    assert sorted(e.get("step") for e in metrics(out, "accept_length")) == [2, 4, 6]
    assert max(e.get("step") for e in metrics(out, "loss")) == 6
    assert (out / "checkpoints" / "step_00000006").is_dir() and (out / "draft" / "config.json").is_file()


@pytest.mark.slow
def test_resume_after_a_kill_continues_the_loss_curve_from_the_checkpoint(tmp_path_factory, tmp_path) -> None:
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    sections = {**TEST_SECTIONS, "train": {**TEST_SECTIONS["train"], "steps": 30, "checkpoint_every": 5}}
    plan = write_plan(tmp_path / "plan.toml", **sections)
    out = tmp_path / "train"
    argv = [
        sys.executable,
        "-m",
        "pipeline.stages.train",
        "--plan",
        str(plan),
        "--out",
        str(out),
        "--input",
        str(ext),
        "--input",
        str(voc),
    ]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if (out / "events.jsonl").is_file() and any(e.get("code") == "checkpoint" for e in events(out)):
            break
        time.sleep(0.02)
    assert p.poll() is None, "training ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    first = events(out)
    first_loss = losses(first)
    killed_at = max(first_loss)
    assert killed_at < 30
    run_stage("pipeline.stages.train", plan, out, [ext, voc])
    second = events(out)[len(first) :]
    resumed = [e for e in second if e.get("code") == "resumed_from_checkpoint"]
    assert resumed, "the retry did not resume"
    ckpt = resumed[0].get("step")
    assert ckpt >= 5 and ckpt % 5 == 0 and ckpt <= killed_at
    second_loss = losses(second)
    assert min(second_loss) == ckpt + 1  # not step 1
    assert max(second_loss) == 30
    for step in range(ckpt + 1, killed_at + 1):  # the steps both attempts ran agree exactly
        # one process, same checkpoint and rows: fp32 order noise only (a floor for a loss near 0)
        assert second_loss[step] == pytest.approx(first_loss[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_online_training_sees_the_same_targets_as_offline(tmp_path_factory, tmp_path) -> None:
    tok, voc = shared(tmp_path_factory, "tok"), shared(tmp_path_factory, "voc")
    offline = losses(events(shared(tmp_path_factory, "train")))
    sections = {
        **TEST_SECTIONS,
        "extract": {"mode": "online"},
        "train": {**TEST_SECTIONS["train"], "steps": 1},
    }
    plan = write_plan(tmp_path / "plan.toml", **sections)
    run_stage("pipeline.stages.extract", plan, tmp_path / "ext", [tok])
    run_stage("pipeline.stages.train", plan, tmp_path / "train", [tmp_path / "ext", voc])
    online = losses(events(tmp_path / "train"))
    assert list(online) == [1]
    # same init, same batch; offline features went through bf16 storage
    assert online[1] == pytest.approx(offline[1], rel=0.03, abs=1e-3)
    assert json.loads((tmp_path / "train" / "manifest.json").read_text())["mode"] == "online"


@pytest.mark.slow
def test_torchrun_two_gloo_processes_equal_one_process(tmp_path_factory, tmp_path) -> None:
    """Issue 9, CPU part: DDP over 2 processes computes exactly the single-process update."""
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    results = {}
    for nproc in (1, 2):
        sections = {
            **TEST_SECTIONS,
            "train": {**TEST_SECTIONS["train"], "steps": 3, "nproc": nproc, "checkpoint_every": 3},
        }
        plan = write_plan(tmp_path / f"plan{nproc}.toml", **sections)
        out = tmp_path / f"train{nproc}"
        run_stage("pipeline.stages.train", plan, out, [ext, voc])
        state = torch.load(out / "checkpoints" / "step_00000003" / "training_state.pt", weights_only=False)
        results[nproc] = (losses(events(out)), state)
    assert results[2][1]["world_size"] == 2 and results[1][1]["world_size"] == 1
    assert_same_training(results[1], results[2])
    ev2 = [e for e in events(tmp_path / "train2") if e.type == "message"]
    assert any("2 process(es)" in e.get("text", "") for e in ev2)


@pytest.mark.slow
def test_a_pause_holds_training_at_a_step_boundary(tmp_path_factory, tmp_path) -> None:
    from pipeline.run.rundir.events import read_all
    from pipeline.run.rundir.layout import RunDir, write_json

    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    plan = write_plan(
        tmp_path / "plan.toml", **{**TEST_SECTIONS, "train": {**TEST_SECTIONS["train"], "steps": 6}}
    )
    run = RunDir(tmp_path / "run")
    sd = run.stage("train")
    sd.out.mkdir(parents=True)
    write_json(sd.pause_flag, {"attempt": 1})  # requested before the first step
    env = {
        **os.environ,
        "AERIE_RUN_DIR": str(run.root),
        "AERIE_STAGE_ID": "train",
        "AERIE_OUT": str(sd.out),
        "AERIE_PLAN": str(plan),
        "AERIE_INPUTS": json.dumps({"extract": str(ext), "vocab": str(voc)}),
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "pipeline.stages.train"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
            e.get("code") == "paused" for e in read_all(sd.events) if sd.events.is_file()
        ):
            assert p.poll() is None, "training exited instead of pausing"
            time.sleep(0.1)
        time.sleep(2.0)
        assert not losses(read_all(sd.events)), "a step ran while paused"
        sd.pause_flag.unlink()
        assert p.wait(timeout=300) == 0
    finally:
        if p.poll() is None:
            p.kill()
    evs = read_all(sd.events)
    codes = [e.get("code") for e in evs if e.type == "message"]
    assert codes.index("paused") < codes.index("resumed")
    assert sorted(losses(evs)) == list(range(1, 7))
