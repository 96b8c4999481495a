"""A GPU load for recording telemetry on a lent GPU: holds memory, optionally keeps the SMs busy.

``python -m bench.gpu.load --hold-gib 8 --seconds 15`` (busy matmuls) or ``--idle`` (only holds
memory, like a forgotten process would). ``--device cpu`` runs the same code without a GPU, so
the recording plan can be tried on a machine without one.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-gib", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--idle", action="store_true", help="hold memory only, no compute")
    ap.add_argument("--device", default=os.environ.get("GPU_LOAD_DEVICE", "cuda"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    n = int(args.hold_gib * (1 << 30))
    hold = torch.empty(n if dev.type == "cuda" else min(n, 1 << 26), dtype=torch.uint8, device=dev)
    hold.fill_(1)
    print(f"gpu_load pid {os.getpid()}: holding {hold.numel() / (1 << 30):.2f} GiB on {dev}", flush=True)
    end = time.monotonic() + args.seconds
    if args.idle:
        while time.monotonic() < end:
            time.sleep(0.2)
        return 0
    size = 8192 if dev.type == "cuda" else 256
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    steps = 0
    while time.monotonic() < end:
        for _ in range(20):
            a = torch.tanh(a @ a)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        steps += 20
    print(f"gpu_load: {steps} matmuls of {size}x{size}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
