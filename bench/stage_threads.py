"""CPU stages side by side: torch's default threads (one per core each) vs OMP_NUM_THREADS = the stage's slots.

    python bench/stage_threads.py [--stages 3] [--steps 30] [--repeat 2]

Starts ``--stages`` processes at once, each doing the same fixed work a small CPU stage does (forward and
backward of a SmolLM2-width MLP block on a 4 x 256-token batch, ``--steps`` times), first with no
``OMP_NUM_THREADS`` (what a stage got before the launcher set it), then with ``OMP_NUM_THREADS`` = cores /
stages (what the launcher now gives a stage holding that many CPU slots). Prints the wall time of the
slowest process and the CPU seconds all of them used, per round, and the ratios. Documented in
docs/performance.md ("CPU threads of a stage").
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

WORK = """
import time, torch
torch.manual_seed(0)
h, f = 576, 1536
w1 = torch.randn(h, f, requires_grad=True); w2 = torch.randn(f, h, requires_grad=True)
x = torch.randn(4 * 256, h)
for _ in range({steps}):
    y = torch.nn.functional.silu(x @ w1) @ w2
    y.square().mean().backward()
"""


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def round_(stages: int, steps: int, threads: int | None) -> tuple[float, float]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cpu0, t0 = children_cpu(), time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORK.format(steps=steps)], env=env) for _ in range(stages)
    ]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a worker failed (exit {p.returncode})")
    return time.monotonic() - t0, children_cpu() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    slots = max(1, cores // a.stages)
    print(f"{a.stages} CPU stages at once on {cores} cores; {a.steps} steps each")
    print(f"{'round':>5}  {'threads':<22} {'wall s':>7} {'CPU s':>7}")
    for r in range(1, a.repeat + 1):
        dw, dc = round_(a.stages, a.steps, None)
        sw, sc = round_(a.stages, a.steps, slots)
        print(f"{r:>5}  {'torch default (' + str(cores) + ')':<22} {dw:7.1f} {dc:7.1f}")
        print(f"{r:>5}  {'OMP_NUM_THREADS=' + str(slots):<22} {sw:7.1f} {sc:7.1f}")
        print(f"       slots / default: wall {sw / dw:.2f}x, CPU {sc / dc:.2f}x")


if __name__ == "__main__":
    main()
