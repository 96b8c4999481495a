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

from pipeline.run import plan as plan_mod
from pipeline.run.events import read_all
from pipeline.run.procs import ProcIdentity, StrangerError, signal_group
from pipeline.run.rundir import RunDir, read_json
from pipeline.run.supervisor import create_run

ROOT = Path(__file__).resolve().parent.parent


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
    return subprocess.Popen([sys.executable, "-m", "pipeline.run.supervisor", str(run.root), "--poll", str(poll)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
    return subprocess.run([sys.executable, "-m", "pipeline.run.ctl", str(run.root), *args], env=env,
                          capture_output=True, text=True, timeout=60)


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
    """Cleanup after a test: SIGKILL the recorded groups of this run's stages (never by name)."""
    for sid in run.stage_ids():
        rec = read_json(run.stage(sid).proc)
        if rec:
            with contextlib.suppress(StrangerError, PermissionError):
                signal_group(ProcIdentity.from_dict(rec), signal.SIGKILL)


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
DATASETS = ["swe-agent", "deepswe-kimi", "opencodeinstruct", "magicoder", "mot", "openthoughts",
            "ultrachat", "sharegpt", "kimi-2000x", "codefeedback"]


def finished_run(root: Path) -> RunDir:
    """A run whose 12 stages all finished, with fixed times: deterministic for snapshots.

    Built from the same files launchers and the supervisor write (proc/exit/events), so the real
    supervisor derives the states; the recorded pids carry an impossible start time, so nothing is
    ever signalled.
    """
    import shutil

    from pipeline.run.events import EventWriter, make
    from pipeline.run.rundir import write_json

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    datasets = "".join(f'[[datasets]]\nname = "{d}"\nsource = "x"\nkind = "target-native"\nquota = 1000\n'
                       for d in DATASETS)
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
        write_json(sd.proc, {"attempt": 1, "pid": 4_000_000 + i, "pgid": 4_000_000 + i, "start_time": 1,
                             "boot_id": "", "t": start})
        done = 1000 if status == "succeeded" else 400 + 30 * i
        with EventWriter(sd.events) as w:
            w.write(make("started", t=start, attempt=1, pid=4_000_000 + i))
            for k in range(1, 5):
                w.write(make("progress", t=start + k * (end - start) / 4, done=done * k // 4, total=1000,
                             unit="rows", key=ds))
            if status == "failed":
                w.write(make("message", t=end, level="error", text="row 412: field 'conversations' missing"))
            w.write(make("finished", t=end, status=status, returncode=0 if status == "succeeded" else 1))
        if status == "killed":
            write_json(sd.kill_marker, {"attempt": 1, "t": end - 1, "reason": "operator"})
        write_json(sd.exit, {"attempt": 1, "returncode": 0 if status == "succeeded" else (-15 if status == "killed" else 1),
                             "signal": "SIGTERM" if status == "killed" else None, "t": end})
        sd.log.write_text(f"===== aerie: {sid} attempt 1 =====\nworking on {ds}\n")
    return run
