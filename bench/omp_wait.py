"""OpenMP waiting policy of a CPU stage: spinning (libgomp's default) vs sleeping (``OMP_WAIT_POLICY=PASSIVE``).

    python bench/omp_wait.py [--busy 1] [--tokens 60] [--repeat 2]

A stage that holds two CPU slots runs torch with two threads. Between parallel regions libgomp's threads
spin for a while before they sleep; when another process holds the cores (the console, the server, another
stage, a test worker) a spinning thread burns the core its descheduled sibling needs. The work here is what
the demo's bench and regen server do most: decoding one token at a time
(the demo's own target, the builtin SmolLM2-135M, greedy with its KV cache through Aerie's capture), ``--tokens``
tokens after an 80-token prompt.

Each configuration runs alone, then beside ``--busy`` other CPU stages with the same threads and policy
(a training-sized matmul loop each), as when the console's machine runs several stages at once. Prints the decoding loop's wall time and the CPU seconds its process used meanwhile (all its threads), and the
ratios against the 2-thread spinning default. Documented in docs/performance.md ("OpenMP threads that wait").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORK = """
import time, torch
from pipeline.eagle3.spec_decode import greedy_generate
from pipeline.eagle3.target_capture import load_target
target = load_target("builtin:smollm2-135m-instruct", [1, 15, 27], dtype=torch.float32, device="cpu")
prompt = list(range(1000, 1080))
greedy_generate(target, prompt, 2, set())  # warm up
t0, c0 = time.perf_counter(), time.process_time()
greedy_generate(target, prompt, {tokens}, set())
print(time.perf_counter() - t0, time.process_time() - c0)
"""

BUSY = """
import torch
w1, w2 = torch.randn(576, 1536), torch.randn(1536, 576)
x = torch.randn(4 * 256, 576)
while True:
    (torch.nn.functional.silu(x @ w1) @ w2).sum()
"""

CONFIGS: list[tuple[str, dict[str, str]]] = [
    ("2 threads, spinning (default)", {"OMP_NUM_THREADS": "2"}),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}),
    ("1 thread", {"OMP_NUM_THREADS": "1"}),
]


def one(tokens: int, extra: dict[str, str], busy: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(extra)
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY], env=env) for _ in range(busy)]
    try:
        time.sleep(0.2 if busy else 0.0)
        out = subprocess.run(
            [sys.executable, "-c", WORK.format(tokens=tokens)], env=env, capture_output=True, text=True
        )
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    if out.returncode != 0:
        raise SystemExit(f"the decoding process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    wall, cpu = (float(v) for v in out.stdout.split())
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, default=1, help="other CPU stages running in the shared rounds")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; {a.tokens} one-token decode steps; shared rounds beside {a.busy} busy processes")
    print(
        f"{'round':>5}  {'machine':<7} {'configuration':<36} {'wall s':>7} {'CPU s':>7} {'wall x':>7} {'CPU x':>6}"
    )
    for r in range(1, a.repeat + 1):
        for label, busy in (("idle", 0), ("shared", a.busy)):
            base: tuple[float, float] | None = None
            for name, extra in CONFIGS:
                wall, cpu = one(a.tokens, extra, busy)
                base = base or (wall, cpu)
                print(
                    f"{r:>5}  {label:<7} {name:<36} {wall:7.2f} {cpu:7.2f} "
                    f"{wall / base[0]:6.2f}x {cpu / base[1]:5.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
