"""Benchmark: CPU cost of the console attached to a live run of 12 stages emitting events.

Starts a real run (12 operator stages, each emitting a progress event every 0.25 s through
pipeline.run.stage_side.runtime), then the real console (AerieApp, Textual headless driver) in its own process,
attached through LocalTransport, and measures that process's CPU time (utime+stime from
/proc/PID/stat) over the measurement window. As a baseline in the same run it measures the same
console attached to a finished run (nothing changes, polling continues).

    python bench/console_idle.py [--seconds 30] [--json]

``--json`` prints one JSON object instead of the text (what ``bench/record.py`` reads).

Goal (docs/performance.md): <= 1 % of a core at rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.rundir.layout import read_json  # noqa: E402
from pipeline.run.supervise.run_setup import create_run  # noqa: E402

POLL_S = 1.0
WORKER = """
import sys, time
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
n = int(sys.argv[1])
for i in range(n):
    ctx.safe_point()
    ctx.progress(i + 1, n, unit="rows", force=True)
    time.sleep(0.25)
"""
CONSOLE = """
import sys
from console.app import AerieApp
from console.transport import LocalTransport
AerieApp(LocalTransport(sys.argv[1]), poll_s=float(sys.argv[2])).run(headless=True, size=(140, 40))
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_run(tmp: Path, n_stages: int, steps: int) -> Path:
    (tmp / "w.py").write_text(WORKER)
    body = f'[run]\nname = "bench"\ndir = "run"\n[resources]\ncpu_slots = {n_stages}\n'
    for i in range(n_stages):
        body += f'[[stage]]\nid = "s{i:02d}"\ncommand = "{sys.executable} {tmp / "w.py"} {steps}"\n'
    (tmp / "plan.toml").write_text(textwrap.dedent(body))
    run = create_run(plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run"), tmp / "run")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", str(run.root)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return run.root


def measure(run_root: Path, seconds: float) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-c", CONSOLE, str(run_root), str(POLL_S)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(5.0)  # start-up (imports, first render) is not "at rest"
        c0, t0 = cpu_seconds(p.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(p.pid), time.monotonic()
    finally:
        p.terminate()
        p.wait(10)
    return 100.0 * (c1 - c0) / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--stages", type=int, default=12)
    ap.add_argument(
        "--poll", type=float, default=1.0, help="the console's poll interval (default as shipped)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object (bench/record.py reads it)")
    args = ap.parse_args()
    global POLL_S
    POLL_S = args.poll
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        steps = int((args.seconds + 20) / 0.25)
        live = make_run(tmp / "live", args.stages, steps) if (tmp / "live").mkdir() is None else None
        time.sleep(2.0)
        live_pct = measure(live, args.seconds)
        events = sum(
            1
            for sid in range(args.stages)
            for _ in open(live / "stages" / f"s{sid:02d}" / "events.jsonl")  # noqa: SIM115
        )
        done = make_run(tmp / "done", 1, 1) if (tmp / "done").mkdir() is None else None
        for _ in range(100):
            if (read_json(done / "state.json") or {}).get("done"):
                break
            time.sleep(0.1)
        idle_pct = measure(done, args.seconds)
    if args.json:
        print(
            json.dumps(
                {"live_pct": live_pct, "finished_pct": idle_pct, "stages": args.stages, "events": events}
            )
        )
        return
    print(
        f"console CPU, attached to {args.stages} live stages (~{args.stages * 4} events/s): {live_pct:.2f} % of a core"
    )
    print(f"console CPU, attached to a finished run (baseline):            {idle_pct:.2f} % of a core")
    print(f"ratio live / finished: {live_pct / idle_pct:.2f}x" if idle_pct > 0 else "ratio: n/a")
    print(f"events written during the run: {events}")


if __name__ == "__main__":
    main()
