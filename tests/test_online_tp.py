"""Online training with a tensor-parallel target (``[train] target = "online-tp"``) on the tiny
Kimi-K2.5-architecture model, 2 gloo ranks on the CPU: equal to offline extraction + training, a
kill resumes at the right data position, and a rank that dies takes the stage down by name."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.kimi_fixture import build_tiny_kimi
from tests.tolerance import SEED, assert_close

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

TRAIN = {
    "steps": 6,
    "batch_size": 4,
    "micro_batch": 2,
    "ttt_steps": 2,
    "checkpoint_every": 2,
    "log_every": 1,
    "nproc": 2,
    "lr": 0.002,
    "keep_checkpoints": 5,
}


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    e["AERIE_DIST_TIMEOUT_S"] = "60"
    return e


def write_plan(path: Path, model: Path, online: bool) -> Path:
    train = {**TRAIN, **({"target": "online-tp"} if online else {})}
    lines = [
        "[run]",
        'name = "otp"',
        f'dir = "{path.parent / "run"}"',
        "[target]",
        f'model = "{model}"',
        "max_length = 256",
        "[extract]",
        'device = "cpu"',
        "batch_tokens = 1024",
        "aux_layers = [1, 2, 4]",
        "[vocab]",
        "draft_vocab_size = 128",
        "[train]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in train.items()]
    lines += ['device = "cpu"', "[bench]", "holdout = 0.2"]
    path.write_text("\n".join(lines) + "\n")
    return path


def stage(
    module: str, plan: Path, out: Path, inputs: list[Path], env: dict | None = None
) -> subprocess.Popen:
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out)]
    for i in inputs:
        argv += ["--input", str(i)]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env or globals()["env"](),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run(module: str, plan: Path, out: Path, inputs: list[Path]) -> str:
    p = stage(module, plan, out, inputs)
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0, text[-5000:]
    return text


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """The tiny Kimi model, its prepped rows and the draft vocabulary, shared by the tests here."""
    d = tmp_path_factory.mktemp("online-tp")
    model = build_tiny_kimi(d / "kimi", seed=SEED)
    fixture = ROOT / "pipeline" / "data" / "fixtures" / "datasets" / "kimik2-5-2000x.jsonl"
    prep_plan = d / "prep.toml"
    prep_plan.write_text(
        f'[run]\nname = "p"\ndir = "{d / "run"}"\n[target]\nmodel = "{model}"\nmax_length = 256\n'
        f"[prep]\nshard_rows = 8\nbatch_rows = 8\ncheck_rows = 8\nreject_threshold = 0.5\n"
        f"[bench]\nholdout = 0.2\n"
        f'[[datasets]]\nname = "kimi"\nsource = "kimik2-5-2000x"\nkind = "target-native"\n'
        f'quota = 24\npath = "{fixture}"\n'
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.stages.prep",
            "--plan",
            str(prep_plan),
            "--dataset",
            "kimi",
            "--out",
            str(d / "tok"),
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    off = write_plan(d / "offline.toml", model, online=False)
    run("pipeline.stages.vocab", off, d / "voc", [d / "tok"])
    return {"dir": d, "model": model, "tok": d / "tok", "voc": d / "voc"}


def final_state(out: Path) -> dict[str, torch.Tensor]:
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    return torch.load(ckpts[-1] / "training_state.pt", map_location="cpu", weights_only=False)["model"]


def steps_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    evs = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["value"] for e in evs if e.get("type") == "metric" and e.get("name") == "loss"}


@pytest.fixture(scope="module")
def online_ext(base) -> Path:
    """The online-mode extraction: the row list only."""
    d = base["dir"]
    run(
        "pipeline.stages.extract",
        write_plan(d / "online.toml", base["model"], online=True),
        d / "ext-on",
        [base["tok"]],
    )
    return d / "ext-on"


@pytest.fixture(scope="module")
def online_run(base, online_ext: Path) -> Path:
    d = base["dir"]
    plan = write_plan(d / "online.toml", base["model"], online=True)
    run("pipeline.stages.train", plan, d / "train-on", [online_ext, base["voc"]])
    return d / "train-on"


def test_online_tp_training_equals_offline_extraction_then_training(base, online_run: Path) -> None:
    """Same rows, same order, same global batch (4 over 2 ranks), 6 steps.

    Tolerance: offline stores the captured states in bf16 and online rounds them through bf16 the
    same way, but the online capture is tensor-parallel (partial sums in another order) and padded
    per training micro-batch instead of per extraction batch, so an input can land on the
    neighbouring bf16 value (2**-7 relative); after 6 AdamW steps the draft's weights agree to
    within 1 % of each tensor's scale and the per-step losses to 1 %."""
    d = base["dir"]
    plan = write_plan(d / "offline.toml", base["model"], online=False)
    run("pipeline.stages.extract", plan, d / "ext-off", [base["tok"]])
    run("pipeline.stages.train", plan, d / "train-off", [d / "ext-off", base["voc"]])
    ext_on = json.loads((d / "ext-on" / "manifest.json").read_text())
    assert ext_on["mode"] == "online" and ext_on["bytes"] == 0 and not list((d / "ext-on").glob("hs-*"))
    man = json.loads((online_run / "manifest.json").read_text())
    assert man["mode"] == "online-tp" and man["world_size"] == 2
    assert [s["rows"] for s in steps_log(online_run)] == [s["rows"] for s in steps_log(d / "train-off")]
    a, b = final_state(online_run), final_state(d / "train-off")
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            # Offline features went through bf16 storage (2**-9 relative each) and six AdamW steps carry that
            # into every weight: 1 % of each value, plus 1 % of the tensor's largest value as the floor for
            # weights near zero (Adam's normalised step moves a weight by ~lr whatever its size).
            scale = float(b[k].abs().max()) or 1.0
            assert_close(a[k], b[k], rel=0.01, floor=0.01 * scale, what=k)
    lo, lf = losses(online_run), losses(d / "train-off")
    assert sorted(lo) == list(range(1, 7))
    for step in lo:
        assert lo[step] == pytest.approx(lf[step], rel=0.01, abs=1e-3)  # losses of a few nats; floor near 0
    events = (online_run / "events.jsonl").read_text()
    assert "online, target tensor-parallel over the ranks" in events


def test_a_killed_online_tp_stage_resumes_at_the_right_row(base, online_run: Path) -> None:
    """Killed (TERM to the stage's group, as Aerie kills) after its step-2 checkpoint, then run
    again: it resumes from that checkpoint, and the rows it trained on, step by step, are exactly
    the uninterrupted run's — none twice, none skipped — with the same weights."""
    d = base["dir"]
    plan = write_plan(d / "online.toml", base["model"], online=True)
    out = d / "train-kill"
    p = stage("pipeline.stages.train", plan, out, [d / "ext-on", base["voc"]])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None:
        ev = out / "events.jsonl"
        if ev.is_file() and '"code":"checkpoint"' in ev.read_text().replace(" ", ""):
            break
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)
    p.communicate(timeout=120)
    killed_at = max(s["step"] for s in steps_log(out))
    assert killed_at < TRAIN["steps"]
    time.sleep(2)
    assert not leftovers(out)  # the agent and every rank are gone
    run("pipeline.stages.train", plan, out, [d / "ext-on", base["voc"]])
    resumed = [
        json.loads(line)
        for line in (out / "events.jsonl").read_text().splitlines()
        if '"resumed_from_checkpoint"' in line
    ]
    assert resumed and resumed[-1]["step"] >= 2
    log, ref = steps_log(out), steps_log(online_run)
    assert [s["step"] for s in log] == list(range(1, TRAIN["steps"] + 1))
    assert [s["rows"] for s in log] == [s["rows"] for s in ref]
    n_rows = len({r for s in ref for r in s["rows"]})
    per_epoch = n_rows // TRAIN["batch_size"]
    first_epoch = [r for s in log[:per_epoch] for r in s["rows"]]
    assert len(first_epoch) == len(set(first_epoch))  # no row twice within an epoch
    a, b = final_state(out), final_state(online_run)
    for k in a:
        if a[k].is_floating_point():
            # Same world size, rows and checkpointed state: the two can differ only by the order gloo's
            # all-reduce adds the ranks' gradients in (~1e-7 relative after a few steps); the 1e-6 floor is
            # for weights near zero, far below one AdamW step (~lr = 1e-3).
            assert_close(a[k], b[k], rel=1e-5, floor=1e-6, what=k)


def leftovers(out: Path) -> list[int]:
    """Processes still running for the stage writing ``out`` (its torchrun agent and every rank)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"--out\0{out}\0".encode() in cmd + b"\0" and state != "Z":
            found.append(int(pid))
    return found


def test_a_rank_that_dies_takes_the_stage_down_by_name(base, online_ext: Path) -> None:
    d = base["dir"]
    plan = write_plan(d / "online.toml", base["model"], online=True)
    plan.write_text(
        plan.read_text()
        .replace("steps = 6", "steps = 400")
        .replace("checkpoint_every = 2", "checkpoint_every = 400")
    )
    out = d / "train-die"
    p = stage("pipeline.stages.train", plan, out, [d / "ext-on", base["voc"]])
    victim = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and victim is None and p.poll() is None:
        ev = out / "events.jsonl"
        if ev.is_file() and '"name":"loss"' in ev.read_text().replace(" ", ""):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if (
                    b"LOCAL_RANK=1" in environ
                    and b"pipeline.stages.train" in cmd
                    and f"--out\0{out}".encode() in cmd
                ):
                    victim = int(pid)
        time.sleep(0.2)
    assert victim, "rank 1 never started: " + (p.communicate()[0][-3000:] if p.poll() is not None else "")
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    text, _ = p.communicate(timeout=300)
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 120, (p.returncode, took)
    msgs = [
        json.loads(line)
        for line in (out / "events.jsonl").read_text().splitlines()
        if '"rank_failed"' in line
    ]
    assert msgs and msgs[-1]["level"] == "error"
    assert msgs[-1]["text"].startswith("rank 1 was killed by SIGKILL"), msgs[-1]["text"]
    assert "its last line:" in msgs[-1]["text"]
    time.sleep(2)
    assert not leftovers(out)


def test_a_rank_that_hangs_makes_the_others_fail_after_the_timeout(base, online_ext: Path) -> None:
    """A frozen rank (SIGSTOP: a stuck GPU, a deadlocked worker) must not hang the stage forever: the
    others' collectives give up after AERIE_DIST_TIMEOUT_S and the stage fails naming a rank."""
    d = base["dir"]
    plan = write_plan(d / "online.toml", base["model"], online=True)
    plan.write_text(
        plan.read_text()
        .replace("steps = 6", "steps = 400")
        .replace("checkpoint_every = 2", "checkpoint_every = 400")
    )
    out = d / "train-hang"
    p = stage(
        "pipeline.stages.train",
        plan,
        out,
        [d / "ext-on", base["voc"]],
        env={**env(), "AERIE_DIST_TIMEOUT_S": "15"},
    )
    victim = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and victim is None and p.poll() is None:
        ev = out / "events.jsonl"
        if ev.is_file() and '"name":"loss"' in ev.read_text().replace(" ", ""):
            victim = next(
                (
                    pid
                    for pid in leftovers(out)
                    if b"LOCAL_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                ),
                None,
            )
        time.sleep(0.2)
    assert victim, "rank 1 never started: " + (p.communicate()[0][-3000:] if p.poll() is not None else "")
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        text, _ = p.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert p.returncode != 0 and time.monotonic() - t0 < 240
    msgs = [
        json.loads(line)
        for line in (out / "events.jsonl").read_text().splitlines()
        if '"rank_failed"' in line
    ]
    assert msgs and msgs[-1]["text"].startswith("rank "), text[-3000:]
    time.sleep(2)
    assert not leftovers(out)
