"""How long drawing the curves costs: one Plotext build of the detail pane's plot and of the metrics view.

    python bench/plot_render.py [--repeat 20] [--json]

The detail pane redraws its plot at most once per poll (1 s) and only when the stage reported a new
metric; the metrics view the same. Both plot full series (512 points, the history's bound).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from textual_plotext.plot import Plot

from console.series import MAX_POINTS


def timed(build: Plot, repeat: int) -> float:
    build.build()  # warm-up
    t = time.perf_counter()
    for _ in range(repeat):
        build.build()
    return (time.perf_counter() - t) / repeat * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON object (bench/record.py reads it)")
    args = ap.parse_args()
    xs = list(range(MAX_POINTS))
    mini = Plot()
    mini.plot(xs, [2 + math.exp(-x / 100) for x in xs], marker="braille", label="loss")
    mini.plot(
        xs, [0.7 * (1 - math.exp(-x / 100)) for x in xs], marker="braille", yside="right", label="acc_0"
    )
    mini.plotsize(44, 8)
    full = Plot()
    full.subplots(4, 1)
    for i in range(1, 5):
        panel = full.subplot(i, 1)
        panel.plot(xs, [math.sin(x / 30) + i for x in xs], marker="braille")
        panel.title(f"metric {i}")
    full.plotsize(190, 45)
    mini_ms, full_ms = timed(mini, args.repeat), timed(full, args.repeat)
    if args.json:
        print(json.dumps({"detail_ms": mini_ms, "metrics_ms": full_ms, "points": MAX_POINTS}))
        return
    print(f"detail pane plot, 2 curves x {MAX_POINTS} points, 44x8:    {mini_ms:6.1f} ms")
    print(f"metrics view, 4 panels x {MAX_POINTS} points, 190x45:    {full_ms:6.1f} ms")


if __name__ == "__main__":
    main()
