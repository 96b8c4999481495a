"""Metrics leave the run as TensorBoard event files (and W&B offline files when the plan asks), written on the
executing host by the stage itself: no console attached, TensorBoard's own reader gets the values back."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

from pipeline.run.plan import dag as plan_mod
from pipeline.run.stage_side.runtime import StageContext
from tests.runs import kill_run_stages, make_run, start_supervisor, stop, wait_done

EventAccumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator"
).EventAccumulator

TRAINING = (
    "from pipeline.run.stage_side.runtime import StageContext\n"
    "ctx = StageContext.from_env()\n"
    "for step in range(0, 50, 10):\n"
    "    ctx.metric('loss', 8.0 / (1 + step), step=step)\n"
    "    ctx.metric('acc_0', step / 100, step=step)\n"
    "ctx.metric('tokens_per_s', 1500.0)\n"
    "ctx.metric('tokens_per_s', 1700.0)\n"
    "ctx.metric('accept_len', 2.5, label='eagle3')\n"
)
PLAN = """
    [run]
    name = "curves"
    dir = "run"
    [[stage]]
    id = "train"
    command = "{python} {script}"
"""


def scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_a_stage_under_the_supervisor_writes_tensorboard_files(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    run = make_run(tmp_path, PLAN.format(python=shlex.quote(sys.executable), script=script))
    sup = start_supervisor(run)
    try:
        assert wait_done(run) == {"train": "succeeded"}
    finally:
        stop(sup)
        kill_run_stages(run)
    logdir = run.root / "tensorboard" / "train"
    assert scalars(logdir, "loss") == [
        (0, 8.0),
        (10, round(8 / 11, 6)),
        (20, round(8 / 21, 6)),
        (30, round(8 / 31, 6)),
        (40, round(8 / 41, 6)),
    ]
    assert scalars(logdir, "acc_0")[-1] == (40, 0.4)
    assert scalars(logdir, "tokens_per_s") == [(0, 1500.0), (1, 1700.0)]  # no step: samples counted
    assert scalars(logdir, "accept_len/eagle3") == [(0, 2.5)]


def test_a_retry_writes_its_own_tensorboard_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for attempt, loss in ((1, 3.0), (2, 2.0)):
        ctx = StageContext(
            "train", tmp_path / "out", tmp_path / "events.jsonl", None, run_dir, attempt=attempt
        )
        ctx.metric("loss", loss, step=100)
        ctx.close()
    assert scalars(run_dir / "tensorboard" / "train", "loss") == [(100, 3.0)]
    assert scalars(run_dir / "tensorboard" / "train" / "attempt-2", "loss") == [(100, 2.0)]


def test_the_wandb_section_is_checked(tmp_path: Path) -> None:
    base = '[run]\nname = "w"\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n'
    for body, key in (
        ('[wandb]\nentity = "me"\n', "wandb.project"),
        ('[wandb]\nproject = "p"\nmode = "cloud"\n', "wandb.mode"),
        ('[wandb]\nproject = "p"\nkey = "secret"\n', "wandb.key"),
    ):
        (tmp_path / "p.toml").write_text(base + body)
        with pytest.raises(plan_mod.PlanError, match=key):
            plan_mod.load(tmp_path / "p.toml")


def test_wandb_offline_files_when_the_plan_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = tmp_path / "plan.toml"
    plan.write_text(
        '[run]\nname = "w"\ndir = "run"\n[wandb]\nproject = "aerie-test"\n'
        '[[stage]]\nid = "train"\ncommand = "true"\n'
    )
    ctx = StageContext("train", tmp_path / "out", tmp_path / "events.jsonl", plan, run_dir)
    for step in (1, 2, 3):
        ctx.metric("loss", 1.0 / step, step=step)
    ctx.close()
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    runfile = next(offline[0].glob("*.wandb"))  # W&B's record log: history items as key + JSON value
    deadline = time.monotonic() + 30  # W&B's service may still be writing it on a loaded host
    while b"0.3333333333333333" not in runfile.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = runfile.read_bytes()
    for value in (1.0, 0.5, 1 / 3):
        assert f"{value!r}".encode() in data, f"loss {value} is not in the offline run"
    assert data.count(b"loss") >= 3
    assert scalars(run_dir / "tensorboard" / "train", "loss")[-1] == (3, round(1 / 3, 6)), "TensorBoard too"
