"""Test helpers: write a plan, create its run, drive a real supervisor, wait on run-dir state."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.run.hosts.procs import ProcIdentity, StrangerError, signal_attempt
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.layout import RunDir, read_json
from pipeline.run.supervise.run_setup import create_run

ROOT = Path(__file__).resolve().parent.parent


def at_normal_priority() -> None:
    """``preexec_fn`` for the demo: undo the niceness a pytest-xdist worker runs at (tests/conftest.py), where
    the OS lets this user raise priority (root); elsewhere the demo simply shares the CPU like the rest."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def write_plan(tmp: Path, body: str, name: str = "plan.toml") -> Path:
    path = tmp / name
    path.write_text(textwrap.dedent(body))
    return path


def make_run(tmp: Path, body: str) -> RunDir:
    path = write_plan(tmp, body)
    plan = plan_mod.load(path, run_dir=tmp / "run")
    return create_run(plan, tmp / "run")


def start_supervisor(run: RunDir, poll: float = 0.1) -> subprocess.Popen:
    """A real supervisor process (its own session, like the detached one)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", str(run.root), "--poll", str(poll)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def states(run: RunDir) -> dict[str, str]:
    snap = read_json(run.state_path) or {"stages": []}
    return {s["id"]: s["state"] for s in snap["stages"]}


def stage_state(run: RunDir, sid: str) -> dict:
    snap = read_json(run.state_path) or {"stages": []}
    return next((s for s in snap["stages"] if s["id"] == sid), {})


def wait_for(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        val = pred()
        if val:
            return val
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_done(run: RunDir, timeout: float = 60.0) -> dict[str, str]:
    wait_for(lambda: (read_json(run.state_path) or {}).get("done"), timeout, "the run to finish")
    return states(run)


def events(run: RunDir, sid: str, type_: str | None = None) -> list:
    evs = read_all(run.stage(sid).events)
    return [e for e in evs if type_ is None or e.type == type_]


def ctl(run: RunDir, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "pipeline.run.supervise.ctl", str(run.root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def kill_run_stages(run: RunDir) -> None:
    """Cleanup after a test: SIGKILL the recorded attempts of this run's stages, their groups and the
    processes that left them (never by name)."""
    for sid in run.stage_ids():
        rec = read_json(run.stage(sid).proc)
        if rec:
            with contextlib.suppress(StrangerError, PermissionError):
                signal_attempt(ProcIdentity.from_dict(rec), signal.SIGKILL)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


FINISHED_PLAN = """
[run]
name = "snapshot"
dir = "run"
[resources]
cpu_slots = 4
gpus = [0]
{datasets}
[[stage]]
id = "prep"
command = "true"
for_each = "dataset"
[[stage]]
id = "train"
command = "true"
after = ["prep.*"]
gpus = [0]
[[stage]]
id = "bench"
command = "true"
after = ["train"]
"""
DATASETS = [
    "swe-agent",
    "deepswe-kimi",
    "opencodeinstruct",
    "magicoder",
    "mot",
    "openthoughts",
    "ultrachat",
    "sharegpt",
    "kimi-2000x",
    "codefeedback",
]


def finished_run(root: Path) -> RunDir:
    """A run whose 12 stages all finished, with fixed times: deterministic for snapshots.

    Built from the same files launchers and the supervisor write (proc/exit/events), so the real
    supervisor derives the states; the recorded pids carry an impossible start time, so nothing is
    ever signalled.
    """
    import shutil

    from pipeline.run.rundir.events import EventWriter, make
    from pipeline.run.rundir.layout import write_json

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    datasets = "".join(
        f'[[datasets]]\nname = "{d}"\nsource = "x"\nkind = "target-native"\nquota = 1000\n' for d in DATASETS
    )
    plan_path = root / "plan.src.toml"
    plan_path.write_text(FINISHED_PLAN.format(datasets=datasets))
    run = create_run(plan_mod.load(plan_path, run_dir=root / "run"), root / "run")
    t0 = 1_796_000_000.0
    outcome = {d: "succeeded" for d in DATASETS}
    outcome["sharegpt"], outcome["codefeedback"] = "failed", "killed"
    for i, sid in enumerate(run.stage_ids()):
        sd = run.stage(sid)
        ds = sid.split(".", 1)[1] if "." in sid else None
        status = outcome.get(ds, "succeeded") if ds else "succeeded"
        if sid in ("train", "bench"):
            status = "upstream-failed"
        if status == "upstream-failed":
            continue
        start = t0 + i * 7
        end = start + 60 + i * 13
        write_json(sd.launch, {"attempt": 1, "t": start})
        write_json(
            sd.proc,
            {
                "attempt": 1,
                "pid": 4_000_000 + i,
                "pgid": 4_000_000 + i,
                "start_time": 1,
                "boot_id": "",
                "t": start,
            },
        )
        done = 1000 if status == "succeeded" else 400 + 30 * i
        with EventWriter(sd.events) as w:
            w.write(make("started", t=start, attempt=1, pid=4_000_000 + i))
            for k in range(1, 5):
                w.write(
                    make(
                        "progress",
                        t=start + k * (end - start) / 4,
                        done=done * k // 4,
                        total=1000,
                        unit="rows",
                        key=ds,
                    )
                )
            if status == "failed":
                w.write(make("message", t=end, level="error", text="row 412: field 'conversations' missing"))
            w.write(make("finished", t=end, status=status, returncode=0 if status == "succeeded" else 1))
        if status == "killed":
            write_json(sd.kill_marker, {"attempt": 1, "t": end - 1, "reason": "operator"})
        write_json(
            sd.exit,
            {
                "attempt": 1,
                "returncode": 0 if status == "succeeded" else (-15 if status == "killed" else 1),
                "signal": "SIGTERM" if status == "killed" else None,
                "t": end,
            },
        )
        sd.log.write_text(f"===== aerie: {sid} attempt 1 =====\nworking on {ds}\n")
    return run


CONSOLE_PLAN = """
[run]
name = "kimi-eagle3"
dir = "run"
[resources]
cpu_slots = 4
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
{datasets}
[[stage]]
id = "prep"
command = "true"
for_each = "dataset"
[[stage]]
id = "telemetry"
run = "telemetry"
service = true
cpu = 0
[[stage]]
id = "train"
command = "true"
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
[[stage]]
id = "bench"
command = "true"
after = ["train"]
"""
TELEMETRY_FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"


def train_metrics(step: int) -> dict[str, float]:
    """Deterministic training curves: loss falls, acceptance rises, with a little wiggle."""
    import math

    wiggle = 0.08 * math.sin(step / 37.0)
    acc = 0.74 * (1 - math.exp(-step / 500.0))
    return {
        "loss": 1.3 + 6.7 * math.exp(-step / 450.0) + wiggle,
        "acc_0": acc + wiggle / 20,
        "acc_1": 0.8 * acc,
        "acc_2": 0.62 * acc,
        "lr": 1e-4 * min(1.0, (step + 1) / 200),
        "tokens_per_s": 41_000 + 900 * math.sin(step / 90),
    }


def _prep_progress(w: Any, ds: str, start: float, last_t: float, done: int, pid: int) -> None:
    """A prep stage's ``started`` event and five progress events evenly from ``start`` to ``last_t``."""
    from pipeline.run.rundir.events import make

    w.write(make("started", t=start, attempt=1, pid=pid))
    for k in range(1, 6):
        t = start + k * (last_t - start) / 5
        w.write(make("progress", t=t, done=done * k // 5, total=120_000, unit="rows", key=ds))


def console_run(root: Path) -> RunDir:
    """A finished run as an operator sees it after two days: 10 preps (one failed, its log saying why), 8 GPUs of
    telemetry, a training that failed once (OOM) and resumed, its curves, and a benchmark. Fixed times."""
    import shutil

    from pipeline.run.rundir.events import EventWriter, make
    from pipeline.run.rundir.layout import write_json

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    datasets = "".join(
        f'[[datasets]]\nname = "{d}"\nsource = "x"\nkind = "target-native"\nquota = 120000\n'
        for d in DATASETS
    )
    plan_path = root / "plan.src.toml"
    plan_path.write_text(CONSOLE_PLAN.format(datasets=datasets))
    run = create_run(plan_mod.load(plan_path, run_dir=root / "run"), root / "run")
    t0 = 1_796_000_000.0
    pid = 4_100_000

    def finish(sid: str, attempt: int, start: float, end: float, rc: int, error: str = "") -> None:
        sd = run.stage(sid)
        if attempt > 1:
            write_json(sd.attempt_file, {"attempt": attempt})
        write_json(sd.launch, {"attempt": attempt, "t": start})
        write_json(
            sd.proc, {"attempt": attempt, "pid": pid, "pgid": pid, "start_time": 1, "boot_id": "", "t": start}
        )
        write_json(
            sd.exit,
            {
                "attempt": attempt,
                "returncode": rc,
                "signal": None,
                "t": end,
                **({"error": error} if error else {}),
            },
        )

    for i, ds in enumerate(DATASETS):
        sid = f"prep.{ds}"
        start, end = t0 + i * 40, t0 + 1800 + i * 330
        ok = ds != "sharegpt"
        done = 120_000 if ok else 48_211
        error = "" if ok else "KeyError: 'conversations' (row 48212 of sharegpt_V3_filtered.json)"
        with EventWriter(run.stage(sid).events) as w:
            _prep_progress(w, ds, start, end, done, pid)
            w.write(
                make(
                    "finished",
                    t=end,
                    status="succeeded" if ok else "failed",
                    returncode=0 if ok else 1,
                    **({} if ok else {"error": error}),
                )
            )
        run.stage(sid).log.write_text(
            f"===== aerie: {sid} attempt 1 started =====\nreading {ds}: 120,000 rows wanted\n"
            + (
                ""
                if ok
                else 'Traceback (most recent call last):\n  File "prep/rows.py", line 41, in rows\n'
                "    turns = row['conversations']\n" + error + "\n"
            )
        )
        finish(sid, 1, start, end, 0 if ok else 1, error)

    tel = run.stage("telemetry")
    tel.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for line in TELEMETRY_FIXTURE.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "gpu":
            for g in range(8):
                procs = [
                    {"pid": 5000 + g, "mem": 96 << 30, "type": "compute", "owner": "train", "name": "python3"}
                ]
                lines.append(
                    json.dumps(
                        dict(
                            r,
                            index=g,
                            util=min(100, r["util"] + 3 * g),
                            mem_used=(98 << 30) + g * (1 << 30),
                            temp_c=r["temp_c"] + g,
                            procs=procs,
                        )
                    )
                )
        else:
            lines.append(line)
    (tel.out / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    finish("telemetry", 1, t0, t0 + 9000, 0)
    with EventWriter(tel.events) as w:
        w.write(make("started", t=t0, attempt=1, pid=pid))
        w.write(make("finished", t=t0 + 9000, status="succeeded", returncode=0))

    train = run.stage("train")
    with EventWriter(train.events) as w:
        for attempt, (s0, s1, start) in enumerate(((0, 800, t0 + 3600), (600, 2000, t0 + 6000)), start=1):
            w.write(make("started", t=start, attempt=attempt, pid=pid))
            for step in range(s0, s1 + 1, 20):
                t = start + (step - s0) * 1.5
                for name, value in train_metrics(step).items():
                    w.write(make("metric", t=t, name=name, value=value, step=step))
                w.write(make("progress", t=t, done=step, total=2000, unit="steps"))
            if attempt == 1:
                w.write(make("message", t=start + 1201, level="error", text="CUDA out of memory at step 800"))
                w.write(
                    make(
                        "finished",
                        t=start + 1202,
                        status="failed",
                        returncode=1,
                        error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB",
                    )
                )
        w.write(make("finished", t=t0 + 8100, status="succeeded", returncode=0))
    train.log.write_text(
        "===== aerie: train attempt 2 started 2026-12-01 06:13:20 pid 4100000 =====\n"
        + "".join(
            f"[rank0] step {s:>5}/2000 loss {m['loss']:.4f} acc_0 {m['acc_0']:.4f} acc_1 {m['acc_1']:.4f} "
            f"lr {m['lr']:.2e} tok/s {m['tokens_per_s']:,.0f} ckpt out/checkpoints/step-{s // 200 * 200:06d}\n"
            for s in range(600, 2001, 100)
            for m in [train_metrics(s)]
        )
    )
    finish("train", 2, t0 + 6000, t0 + 8100, 0)

    bench = run.stage("bench")
    with EventWriter(bench.events) as w:
        w.write(make("started", t=t0 + 8200, attempt=1, pid=pid))
        w.write(make("metric", t=t0 + 8500, name="accept_len", value=2.91, label="eagle3"))
        w.write(make("metric", t=t0 + 8500, name="output_tok_s", value=1812.4, label="eagle3"))
        w.write(make("finished", t=t0 + 8600, status="succeeded", returncode=0))
    bench.log.write_text("===== aerie: bench attempt 1 started =====\naccept length 2.91 over 80 prompts\n")
    finish("bench", 1, t0 + 8200, t0 + 8600, 0)
    return run


MIXED_NOW = 1_796_219_540.0  # "now" for mixed_run's snapshots: just after its telemetry's last sample


def mixed_run(root: Path, now: float = MIXED_NOW) -> RunDir:
    """A live run as an operator finds it at 3 a.m.: 10 preps (6 succeeded, 1 failed with its reason, 3
    running with progress), the telemetry agent (8 GPUs), and train and bench waiting. Its ``state.json``
    is written here as the supervisor would (fixed pids and times, a supervisor that just wrote): a test
    runs the console without one (nothing then rewrites the file) and with ``time.time`` frozen at ``now``,
    so the screen is the same on every machine."""
    import shutil

    from pipeline.run.rundir.events import EventWriter, make
    from pipeline.run.rundir.layout import write_json

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    datasets = "".join(
        f'[[datasets]]\nname = "{d}"\nsource = "x"\nkind = "target-native"\nquota = 120000\n'
        for d in DATASETS
    )
    plan_path = root / "plan.src.toml"
    plan_path.write_text(CONSOLE_PLAN.format(datasets=datasets))
    run = create_run(plan_mod.load(plan_path, run_dir=root / "run"), root / "run")
    t0 = now - 3600
    rows: list[dict] = []
    fate = ["succeeded"] * 6 + ["failed"] + ["running"] * 3
    for i, ds in enumerate(DATASETS):
        sid, state = f"prep.{ds}", fate[i]
        start = t0 + i * 60
        end = start + 900 + i * 30 if state != "running" else None
        pid = 4_200_000 + i
        done = 120_000 if state == "succeeded" else (48_211 if state == "failed" else 20_000 * (i - 6))
        last_t = end or now - 5
        reason = f"KeyError: 'conversations' (row 48212 of {ds}.jsonl)" if state == "failed" else ""
        with EventWriter(run.stage(sid).events) as w:
            _prep_progress(w, ds, start, last_t, done, pid)
            if end is not None:
                extra = {"error": reason} if reason else {}
                w.write(make("finished", t=end, status=state, returncode=0 if not reason else 1, **extra))
        run.stage(sid).log.write_text(
            f"===== aerie: {sid} attempt 1 started =====\nreading {ds}: 120,000 rows wanted\n"
            + "".join(
                f"{ds}: {n:,} rows kept, {n // 400} rejected\n"
                for n in range(1000, done + 1, max(1, done // 40))
            )
            + (
                'Traceback (most recent call last):\n  File "prep/rows.py", line 41, in rows\n'
                f"    turns = row['conversations']\n{reason}\n"
                if reason
                else ""
            )
        )
        rows.append(
            {
                "id": sid,
                "family": "prep",
                "dataset": ds,
                "state": state,
                "attempt": 1,
                "pid": pid,
                "pgid": pid,
                "started_at": start,
                "finished_at": end,
                "returncode": None if end is None else (1 if reason else 0),
                "reason": reason,
                "run": "prep",
                "progress": {"t": last_t, "done": done, "total": 120_000, "unit": "rows"},
            }
        )
    tel = run.stage("telemetry")
    tel.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for line in TELEMETRY_FIXTURE.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "gpu":
            lines += [json.dumps(dict(r, index=g, util=0, mem_used=1 << 30, procs=[])) for g in range(8)]
        elif r["kind"] == "disk":  # the filesystem measured, named as the agent names it
            lines.append(json.dumps(dict(r, path=str(run.root), mount="/data (/dev/nvme1n1)")))
        else:
            lines.append(line)
    (tel.out / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    with EventWriter(tel.events) as w:
        w.write(make("started", t=t0, attempt=1, pid=4_200_100))
    rows.append(
        {
            "id": "telemetry",
            "family": "telemetry",
            "state": "running",
            "attempt": 1,
            "pid": 4_200_100,
            "pgid": 4_200_100,
            "started_at": t0,
            "service": True,
            "run": "telemetry",
        }
    )
    rows.append(
        {
            "id": "train",
            "family": "train",
            "state": "pending",
            "reason": "waiting for prep.ultrachat (failed)",
            "gpus": list(range(8)),
        }
    )
    rows.append({"id": "bench", "family": "bench", "state": "pending", "after": ["train"]})
    write_json(
        run.state_path,
        {
            "run": "kimi-eagle3",
            "run_dir": str(run.root),
            "executor": "local",
            "supervisor": {"pid": 4_200_200, "t": now},
            "stages": rows,
            "done": False,
        },
    )
    return run
