"""The telemetry agent's own CPU cost per sample, with 8 GPUs' worth of records.

``python bench/telemetry_cost.py [--samples 300] [--repeats 5] [--live 8]``

GPU readings come from a FAKE NVML (:class:`pipeline.run.hosts.gpus.FakeNvmlReplay`) replaying the real H200
recording (tests/fixtures/telemetry/h200-2026-12-02.jsonl) replicated to 8 GPUs, every GPU with the
recorded processes, so every sample also maps processes to stages through a run dir of 24 stages
with recorded process groups. Baseline in the same run: the same agent with no GPUs (disk + host
only). Printed: CPU ms per sample (median of the repeats), the ratio to the baseline, the share of
one core at the plan's default 2 s interval, the run-dir projection (every 30 s, amortised), and the
file growth per hour. ``--live N`` also runs the agent's real loop at the 2 s interval for N samples
(both agents): between samples the process sleeps and its caches go cold, which a tight loop hides.
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

from pipeline.run.hosts.gpus import FakeNvmlReplay, GpuUnavailable  # noqa: E402
from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.rundir.layout import RunDir, write_json  # noqa: E402
from pipeline.run.supervise.run_setup import create_run  # noqa: E402
from pipeline.stages.telemetry import Agent, run_loop  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"
INTERVAL_S = 2.0
PROJECTION_EVERY_S = 30.0


class NoGpus:
    """Baseline source: a host without a driver."""

    def open(self) -> dict:
        raise GpuUnavailable("baseline: no GPUs")

    def sample(self) -> list:
        return []

    def close(self) -> None:
        return None


def busy_fixture(tmp: Path) -> Path:
    """The recording with every sample holding a process (the busiest case for ownership mapping)."""
    recs = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    procs = next(r["procs"] for r in recs if r["kind"] == "gpu" and r["procs"])
    for r in recs:
        if r["kind"] == "gpu" and not r["procs"]:
            r["procs"] = procs
    path = tmp / "busy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def make_run(tmp: Path) -> tuple[RunDir, plan_mod.Plan]:
    ds = "".join(
        f'[[datasets]]\nname = "d{i}"\nsource = "s"\nkind = "target-native"\nquota = 1000\n'
        for i in range(10)
    )
    body = f"""
[run]
name = "bench"
dir = "run"
[resources]
cpu_slots = 4
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
{ds}
[[stage]]
id = "prep"
command = "true"
for_each = "dataset"
output_bytes = 1000000000
[[stage]]
id = "regen"
command = "true"
for_each = "dataset"
after = ["prep.{{dataset}}"]
[[stage]]
id = "train"
command = "true"
after = ["regen.*"]
gpus = "all"
output_bytes = 50000000000
[[stage]]
id = "telemetry"
run = "telemetry"
service = true
cpu = 0
"""
    (tmp / "plan.toml").write_text(body)
    plan = plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run")
    run = create_run(plan, tmp / "run")
    for i, sid in enumerate(run.stage_ids()):  # recorded groups that no longer exist
        write_json(
            run.stage(sid).proc,
            {
                "attempt": 1,
                "pid": 3_900_000 + i,
                "pgid": 3_900_000 + i,
                "start_time": 1,
                "boot_id": "",
                "t": 0,
            },
        )
    return run, plan


def cpu_per_sample(agent: Agent, n: int) -> float:
    agent.sample()  # warm-up: first reads, caches
    t0 = time.process_time()
    for _ in range(n):
        agent.sample()
    return (time.process_time() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--live", type=int, default=8, help="samples of the real 2 s loop per agent (0: skip)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run, plan = make_run(tmp)
        fx = busy_fixture(tmp)
        quiet = {"message": lambda *a, **k: None, "projection_every_s": 1e9}
        gpu_agent = Agent(FakeNvmlReplay(fx, replicate=8), tmp / "out8", run=run, plan=plan, **quiet)
        base_agent = Agent(NoGpus(), tmp / "out0", run=run, plan=plan, **quiet)
        replay = FakeNvmlReplay(fx, replicate=8)
        replay.open()
        gpu_t, base_t, replay_t = [], [], []
        for _ in range(args.repeats):
            base_t.append(cpu_per_sample(base_agent, args.samples))
            gpu_t.append(cpu_per_sample(gpu_agent, args.samples))
            t0 = time.process_time()
            for _ in range(args.samples):
                replay.sample()
            replay_t.append((time.process_time() - t0) / args.samples)
        # The projection of the remaining output (state.json + plan + out dirs), every 30 s.
        t0 = time.process_time()
        for _ in range(20):
            gpu_agent._projection = None
            gpu_agent._projected_remaining(time.time())
        proj = (time.process_time() - t0) / 20
        live = {}
        for name, agent in (("baseline", base_agent), ("8 GPUs", gpu_agent)):
            if args.live:
                agent.interval_s = INTERVAL_S
                t0 = time.process_time()
                run_loop(agent, None, samples=args.live)
                live[name] = (time.process_time() - t0) / args.live
        recs = gpu_agent.sample()
        sample_bytes = sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in recs)
        gpu_agent.close()
        base_agent.close()
    g, b, r = statistics.median(gpu_t), statistics.median(base_t), statistics.median(replay_t)
    amortised = g + proj * INTERVAL_S / PROJECTION_EVERY_S
    print(f"telemetry agent CPU per sample (median of {args.repeats} x {args.samples} samples)")
    print(f"  baseline, no GPUs (disk + host):        {1e3 * b:7.3f} ms")
    print(f"  8 GPUs (fake NVML replay of the H200):  {1e3 * g:7.3f} ms   ({g / b:.1f}x baseline)")
    print(f"    of which the fake NVML replay itself: {1e3 * r:7.3f} ms")
    print(f"  projection of remaining output:         {1e3 * proj:7.3f} ms every {PROJECTION_EVERY_S:g} s")
    print(f"  amortised per sample:                   {1e3 * amortised:7.3f} ms")
    print(
        f"  share of one core at {INTERVAL_S:g} s interval:      {100 * amortised / INTERVAL_S:7.3f} %  (goal: well under 1 %)"
    )
    for name, v in live.items():
        print(
            f"  live loop at {INTERVAL_S:g} s, {name + ':':<9}            {1e3 * v:7.3f} ms   "
            f"= {100 * v / INTERVAL_S:.3f} % of a core"
        )
    print(
        f"  file growth: {sample_bytes} B/sample = {sample_bytes * 3600 / INTERVAL_S / 2**20:.1f} MiB/h "
        "(capped by [telemetry] max_mb, one rotation kept)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
