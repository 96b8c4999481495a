"""The local (CPU) inference server's compute threads: torch's default vs the stage's CPU slots.

    python bench/local_server_threads.py [--threads 1] [--max-tokens 24]

Starts ``transformers serve`` on SmolLM2-135M-Instruct twice, the way the serve stage's ``local``
backend does: once with torch's default thread count (one per core), once with ``OMP_NUM_THREADS``
= the given slots (what the stage sets). Each time it times two requests one after the other and two
at once (regeneration's concurrency 2). A request over ``--timeout`` seconds is reported as such.
``--busy N`` runs N busy-looping processes meanwhile: the shared machine the demo runs on, where
other stages (and other people) keep the cores busy.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data.model_assets import resolve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: str, threads: int | None, max_tokens: int, timeout: float) -> tuple[float, float]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1")
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            model,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)

        def req(i: int) -> None:
            body = json.dumps(
                {
                    "model": model,
                    "max_tokens": max_tokens,
                    "messages": [
                        {"role": "user", "content": f"Write a short poem about the sea, number {i}."}
                    ],
                }
            ).encode()
            r = urllib.request.Request(
                url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            )
            urllib.request.urlopen(r, timeout=timeout).read()

        req(0)  # warm-up
        t = time.perf_counter()
        req(1)
        req(2)
        seq = time.perf_counter() - t
        t = time.perf_counter()
        try:
            with cf.ThreadPoolExecutor(2) as ex:
                list(ex.map(req, [3, 4]))
            par = time.perf_counter() - t
        except OSError:
            par = float("inf")
        return seq, par
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="the stage's CPU slots (the demo's serve has 1)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes to run meanwhile")
    args = ap.parse_args()
    model = resolve("builtin:smollm2-135m-instruct")
    print(
        f"cores: {os.cpu_count()}, load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}, "
        f"busy processes: {args.busy}"
    )
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        base = measure(model, None, args.max_tokens, args.timeout)
        pinned = measure(model, args.threads, args.max_tokens, args.timeout)
    finally:
        for h in hogs:
            h.kill()
            h.wait()

    def fmt(x: float) -> str:
        return f"> {args.timeout:g}s" if x == float("inf") else f"{x:6.1f}s"

    print(f"torch default threads:   2 sequential {fmt(base[0])}   2 at once {fmt(base[1])}")
    print(f"OMP_NUM_THREADS={args.threads}:       2 sequential {fmt(pinned[0])}   2 at once {fmt(pinned[1])}")
    print(
        f"speed-up with pinned threads: sequential {base[0] / pinned[0]:.1f}x, at once {base[1] / pinned[1]:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
