"""The alert rules' CPU cost in the supervisor: one :meth:`RunWatcher.tick` per supervisor cycle.

``python bench/alerts_cost.py [--cycles 120] [--scales 1,10,100] [--json]``

The stages are the 28 of the reference plan (examples/kimi-k2.5.toml), copied ``scale`` times (28, 280, 2800
stages). Two cases per scale, both measured with ``time.process_time`` around the watcher's tick only (the
stages' writes are not counted: they are the stages' own cost):

* **busy** — every non-service stage running and writing, between two cycles, what a busy stage writes in
  0.5 s at most: a ``progress`` event, and for a training stage a ``loss`` metric too (real runs write far
  less: a training step every few seconds, progress throttled to 4/s); the telemetry agent's GPU and disk
  records each cycle;
* **idle** — the same stages running, nothing written: the per-cycle floor (a ``stat`` per running stage and
  the clock rules).

Printed: CPU ms per cycle (median), the share of one core at the supervisor's default 0.5 s cycle, the cost per
running stage (µs), and the growth from the smallest scale (linear: the ratio follows the stage count). The
28-stage busy share is the figure the issue bounds at 0.2 % of a core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.alerts.watcher import RunWatcher  # noqa: E402
from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.plan.sections import AlertsSection  # noqa: E402
from pipeline.run.rundir.events import EventWriter  # noqa: E402
from pipeline.run.rundir.layout import RunDir  # noqa: E402
from pipeline.run.rundir.stage_row import StageRow, StageState  # noqa: E402

CYCLE_S = 0.5  # the supervisor's default --poll
PLAN = ROOT / "examples" / "kimi-k2.5.toml"


def rows_for(plan: plan_mod.Plan, scale: int) -> dict[str, StageRow]:
    """The plan's stages ``scale`` times over, each running (its attempt 1 started a minute ago)."""
    now = time.time()
    rows: dict[str, StageRow] = {}
    for k in range(scale):
        for s in plan.stages:
            sid = s.id if k == 0 else f"{s.id}-x{k}"
            if s.run == "telemetry" and k:
                continue  # one telemetry agent per run
            row = StageRow(id=sid, family=s.family, service=s.service, gpus=list(s.gpus), run=s.run)
            row.state, row.attempt, row.started_at = StageState.RUNNING, 1, now - 60
            rows[sid] = row
    return rows


def one_case(plan: plan_mod.Plan, scale: int, busy: bool, cycles: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aerie-alerts-cost-") as d:
        run = RunDir(d)
        rows = rows_for(plan, scale)
        writers = {}
        for sid in rows:
            (Path(d) / "stages" / sid / "out").mkdir(parents=True)
            w = EventWriter(run.stage(sid).events)
            w.emit("started", attempt=1, pid=1)
            writers[sid] = w
        tel = Path(d) / "stages" / "telemetry" / "out" / "telemetry.jsonl"
        watcher = RunWatcher(run, AlertsSection(), lambda _t: None)
        watcher.tick(rows, time.time())  # the first cycle reads every file from its start: not counted
        costs = []
        for i in range(cycles):
            if busy:
                for sid, row in rows.items():
                    if row.service:
                        continue
                    writers[sid].emit("progress", done=i + 1, total=10_000, unit="rows")
                    if row.run == "train":
                        writers[sid].emit("metric", name="loss", value=3.0 - i * 1e-3, step=i)
                with tel.open("a") as fh:
                    t = time.time()
                    fh.write(
                        "".join(
                            json.dumps({"kind": "gpu", "t": t, "index": g, "util": 97.0, "mem_used": 7e10})
                            + "\n"
                            for g in range(8)
                        )
                    )
                    fh.write(json.dumps({"kind": "disk", "t": t, "avail": 9e12, "reserve": 1e11}) + "\n")
            c0 = time.process_time()
            watcher.tick(rows, time.time())
            costs.append(time.process_time() - c0)
        for w in writers.values():
            w.close()
        running = sum(1 for r in rows.values())
        ms = statistics.median(costs) * 1000
        return {
            "stages": len(rows),
            "ms_per_cycle": ms,
            "pct_of_core": 100 * ms / 1000 / CYCLE_S,
            "us_per_stage": 1000 * ms / running,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=120)
    ap.add_argument("--scales", default="1,10,100")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plan = plan_mod.load(PLAN, run_dir=tempfile.gettempdir())
    scales = [int(x) for x in args.scales.split(",")]
    out: dict[str, dict[str, dict[str, float]]] = {"busy": {}, "idle": {}}
    for scale in scales:
        cycles = max(10, args.cycles // scale)  # the big plans: fewer cycles, each longer
        for case in ("busy", "idle"):
            out[case][str(scale)] = one_case(plan, scale, case == "busy", cycles)
    base = out["busy"][str(scales[0])]
    if args.json:
        print(json.dumps({**out, "reference_busy_pct": base["pct_of_core"]}))
        return 0
    print(f"alert rules in the supervisor, one tick per {CYCLE_S:g} s cycle ({PLAN.name} × scale)")
    for case in ("busy", "idle"):
        for scale in scales:
            r = out[case][str(scale)]
            growth = r["ms_per_cycle"] / out[case][str(scales[0])]["ms_per_cycle"]
            print(
                f"  {case:<5} {int(r['stages']):>5} stages: {r['ms_per_cycle']:8.3f} ms/cycle "
                f"= {r['pct_of_core']:6.3f} % of a core, {r['us_per_stage']:6.1f} µs per stage, "
                f"×{growth:.1f} the {int(out[case][str(scales[0])]['stages'])}-stage cost"
            )
    print(f"reference plan, busy: {base['pct_of_core']:.3f} % of a core (bound: 0.2 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
