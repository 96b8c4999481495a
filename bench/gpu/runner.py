"""The device runner: where the lent machine keeps the bench's things, the log clock, the process groups the
bench started (each recorded, each ended by its own group), and a pipeline stage run by its command line.

The machine keeps ``/tmp`` while it stays warm, so everything a later call reuses lives under ``BASE``
(``/tmp/sgl``); what comes back to the caller goes to ``OUT`` (``$OUT``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BASE = Path("/tmp/sgl")
SITE = BASE / "site"
OUT = Path(os.environ.get("OUT") or "/tmp/sgl/out")
PIDS = BASE / "server.pids"
T0 = time.monotonic()
_STARTED: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def track(p: subprocess.Popen) -> subprocess.Popen:
    """Remember a process this bench started in its own session: ``kill_started`` ends its group."""
    _STARTED.append(p)
    return p


def kill_started(*signum: Any) -> None:
    """SIGKILL the process group of every tracked process still running; as a SIGTERM handler, then exit 1."""
    for p in _STARTED:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    if signum:
        raise SystemExit(1)


def kill_leftover() -> None:
    """End the server process group an earlier call on this warm machine recorded in ``PIDS`` and left running."""
    if PIDS.exists():
        pid = int(PIDS.read_text())
        try:
            os.killpg(pid, signal.SIGKILL)
            log(f"killed a server left by an earlier call (pgid {pid})")
            time.sleep(3)
        except ProcessLookupError:
            pass
        PIDS.unlink()


def run_stage(module: str, plan: Path, out: Path, inputs: list[Path], *extra: str) -> float:
    """``python -m MODULE --plan PLAN --out OUT [EXTRA] --input I ...`` from the repository root; its seconds."""
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out), *extra]
    for i in inputs:
        argv += ["--input", str(i)]
    t = time.monotonic()
    env = dict(os.environ)
    # datasets (+ dill, multiprocess): prep reads JSONL through it, and the image lacks it.
    if (BASE / "extra").is_dir():
        env["PYTHONPATH"] = str(BASE / "extra")
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:])
        raise RuntimeError(f"{module} failed ({p.returncode})")
    dt = time.monotonic() - t
    log(f"{module} {dt:.0f} s")
    return dt
