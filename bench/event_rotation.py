"""Benchmark: rotating an ``events.jsonl`` that holds one huge raw line, and the wait of the next event.

Something that bypasses the event writer (a stage printing JSON into its events file) can leave a line of
any size. For each ``--sizes`` (MiB; default 25, 50, 100) the file gets a ``started`` event, progress,
the raw line, and more progress; then two writers (the launcher's and the stage's, in this process, as
two ``EventWriter``s on the file) write their next events with the rotation limit below the file's size:

* ``rotate_ms``: the event whose write rotates the file (it reads the generation for the carried head);
* ``next_wait_ms``: the other writer's next event, written while that rotation runs (from a thread): how
  long the rotation holds it up (the goal: at most 100 ms whatever the line's size);
* ``peak_mb``: the most memory the rotation allocated (tracemalloc), which must not grow with the line
  faster than linearly (before: 143/268/518 MB and 2.9/7.3/32 s for 25/50/100 MiB, a 37 s wait).

    python bench/event_rotation.py [--sizes 25,50,100] [--json]

``--json`` prints one JSON object (what ``bench/record.py`` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.run.rundir.events import EventWriter, read_all  # noqa: E402

MiB = 1 << 20


def one(size_mib: int, root: Path) -> dict[str, float]:
    path = root / f"events-{size_mib}.jsonl"
    with EventWriter(path, rotate_bytes=0) as w:
        w.emit("started", attempt=1, pid=1)
        for i in range(100):
            w.emit("progress", done=i, total=100)
    with open(path, "ab") as fh:  # the raw line, written past the event writer
        block = b'{"type":"message","t":1,"level":"info","text":"' + b"x" * (MiB - 60)
        for _ in range(size_mib):
            fh.write(block)
        fh.write(b'"}\n')
    with EventWriter(path, rotate_bytes=0) as w:
        w.emit("progress", done=100, total=100)
    os.sync()
    limit = path.stat().st_size - 10  # the next event rotates
    rotating, other = EventWriter(path, rotate_bytes=limit), EventWriter(path, rotate_bytes=1 << 40)
    waits: list[float] = []
    started = threading.Event()

    def write_next() -> None:
        started.wait()
        time.sleep(0.005)  # inside the rotation
        for _ in range(20):
            t0 = time.perf_counter()
            other.emit("metric", name="loss", value=0.5)
            waits.append(time.perf_counter() - t0)
            time.sleep(0.005)

    th = threading.Thread(target=write_next)
    th.start()
    tracemalloc.start()
    t0 = time.perf_counter()
    started.set()
    rotating.emit("progress", done=101, total=101)
    rotate_s = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    th.join()
    rotating.close()
    other.close()
    head = read_all(path)
    assert head and head[0].type == "started", "the carried head lost the attempt"
    return {"rotate_ms": rotate_s * 1000, "next_wait_ms": max(waits) * 1000, "peak_mb": peak / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="25,50,100")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            out[str(n)] = one(n, Path(tmp))
            for p in Path(tmp).iterdir():
                p.unlink()
    if args.json:
        print(json.dumps({"sizes": out}))
        return 0
    for n, r in out.items():
        print(
            f"{n:>4} MiB line: rotation {r['rotate_ms']:8.1f} ms · the other writer's next event waited "
            f"{r['next_wait_ms']:6.1f} ms · peak {r['peak_mb']:6.1f} MB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
