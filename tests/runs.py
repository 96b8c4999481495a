"""Test helpers: write a plan, create its run, drive a real supervisor, wait on run-dir state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from pipeline import plan as plan_mod
from pipeline.events import read_all
from pipeline.procs import ProcIdentity, StrangerError, signal_group
from pipeline.rundir import RunDir, read_json
from pipeline.supervisor import create_run

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
    return subprocess.Popen([sys.executable, "-m", "pipeline.supervisor", str(run.root), "--poll", str(poll)],
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
    return subprocess.run([sys.executable, "-m", "pipeline.ctl", str(run.root), *args], env=env,
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
            try:
                signal_group(ProcIdentity.from_dict(rec), signal.SIGKILL)
            except (StrangerError, PermissionError):
                pass


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
