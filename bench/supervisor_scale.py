"""Benchmark: a real supervisor on runs of 1,000 / 3,000 / 10,000 stages.

For each size two runs are made (in /dev/shm when it exists: the supervisor, not the disk, is measured)
from a plan of ``N`` stages running ``sleep 600``, and a real supervisor (``python -m
pipeline.run.supervise.supervisor RUN``, its default 0.5 s poll) supervises each:

* **held** — ``cpu_slots = 2``: two stages run and every other one is ready, held by the slots. After the
  first ticks (``--warmup`` s), over ``--seconds``: the supervisor's CPU (utime + stime from ``/proc``) as a
  share of one core and per tick; the longest gap between two ``state.json`` snapshots (its
  ``supervisor.t``); then the time a control action takes to be answered (``skip`` of the last stage,
  queued and waited for as ``aerie skip`` does, without the command's own start-up);
* **launch** — ``cpu_slots = 40``: stages a second the supervisor launches when slots are free: 40 over
  the time from its first launch intent (``launch.json``) to the fortieth launcher running (its
  ``proc.json``).

Goals (issue 46, docs/performance.md): at 10,000 stages at most 15 % of a core held, a snapshot at least
every 2 s, at least 20 launches a second, a control action answered within 2 s. Before that issue: 68 % of
a core at 10,000 held stages, ``state.json`` every ~28 s, 5 launches a minute, ``aerie skip`` timing out.

    python bench/supervisor_scale.py [--sizes 1000,3000,10000] [--seconds 20] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.hosts.procs import ProcIdentity, StrangerError, signal_attempt  # noqa: E402
from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.rundir.layout import RunDir, read_json  # noqa: E402
from pipeline.run.supervise.ctl import request  # noqa: E402
from pipeline.run.supervise.run_setup import create_run  # noqa: E402

TICK_S = os.sysconf("SC_CLK_TCK")


def make(tmp: Path, n: int, slots: int) -> RunDir:
    body = f'[run]\nname = "scale"\ndir = "run"\n[resources]\ncpu_slots = {slots}\n' + "".join(
        f'[[stage]]\nid = "s{i:05d}"\ncommand = "sleep 600"\n' for i in range(n)
    )
    tmp.mkdir(parents=True)
    (tmp / "plan.toml").write_text(body)
    return create_run(plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run"), tmp / "run")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def snapshot_t(run: RunDir) -> float | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return float(read_json(run.state_path)["supervisor"]["t"])
    return None


def start(run: RunDir) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", str(run.root)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def running(run: RunDir) -> int:
    with contextlib.suppress(ValueError, OSError, TypeError):
        return sum(1 for s in read_json(run.state_path)["stages"] if s["state"] == "running")
    return 0


def stop(run: RunDir, sup: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sup.pid, signal.SIGTERM)
    sup.wait(60)
    for _ in range(2):  # a launch the pool was still forking when the supervisor stopped: its record, next
        for sd in run.stages_dir.iterdir():
            rec = read_json(sd / "proc.json") if (sd / "proc.json").exists() else None
            if rec:
                with contextlib.suppress(StrangerError, PermissionError):
                    signal_attempt(ProcIdentity.from_dict(rec), signal.SIGKILL)
        time.sleep(1)


def wait(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout:g}s")


def held(tmp: Path, n: int, seconds: float, warmup: float) -> dict[str, float]:
    run = make(tmp / f"held{n}", n, 2)
    sup = start(run)
    try:
        wait(lambda: running(run) == 2, 300)
        time.sleep(warmup)
        c0, t0, gaps, last = cpu_s(sup.pid), time.monotonic(), [0.0], snapshot_t(run)
        while time.monotonic() - t0 < seconds:
            time.sleep(0.1)
            t = snapshot_t(run)
            if t is not None and last is not None and t != last:
                gaps.append(t - last)
            last = t if t is not None else last
        cpu = (cpu_s(sup.pid) - c0) / (time.monotonic() - t0)
        q0 = time.monotonic()
        code, msg = request(run, "skip", f"s{n - 1:05d}", timeout_s=60)
        control = time.monotonic() - q0
        assert code == 0, msg
    finally:
        stop(run, sup)
    return {
        "cpu_pct": 100 * cpu,
        "cpu_ms_per_tick": 1000 * cpu * 0.5,
        "snapshot_max_s": max(gaps),
        "control_s": control,
    }


def launch_rate(tmp: Path, n: int, slots: int = 40) -> float:
    """Launches a second with ``slots`` free: from the first launch intent to the last of ``slots``
    launchers running (their ``proc.json``, written as each starts)."""
    run = make(tmp / f"launch{n}", n, slots)
    sids = [f"s{i:05d}" for i in range(slots)]
    sup = start(run)
    try:
        wait(lambda: all(run.stage(s).proc.exists() for s in sids), 300)
        first = min(float(read_json(run.stage(s).launch)["t"]) for s in sids)
        last = max(float(read_json(run.stage(s).proc)["t"]) for s in sids)
    finally:
        stop(run, sup)
    return slots / max(last - first, 1e-6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,3000,10000")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="aerie-scale-", dir=shm, ignore_cleanup_errors=True) as tmp:
        for n in [int(x) for x in args.sizes.split(",")]:
            r = held(Path(tmp), n, args.seconds, args.warmup)
            r["launches_per_s"] = launch_rate(Path(tmp), n)
            out[str(n)] = r
            if not args.json:
                print(
                    f"{n:>6} stages: held by 2 slots {r['cpu_pct']:5.1f} % of a core ({r['cpu_ms_per_tick']:.0f} ms a "
                    f"tick) · state.json at most every {r['snapshot_max_s']:.1f} s · control answered in "
                    f"{r['control_s']:.2f} s · {r['launches_per_s']:.0f} launches/s",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"sizes": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
