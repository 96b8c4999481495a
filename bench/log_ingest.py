"""Benchmark: the log viewer following a log that grows at full speed.

A writer process appends lines to a stage log as fast as it can (batches of 10,000 formatted
lines) until it has written ``--lines`` (default 10M). The console's log screen
(console.screens.logview.LogScreen, Textual headless, through LocalTransport) follows it in its
own process, which measures:

* lines/s the pane sustains: lines indexed and shown per second from the first line to the moment
  it has caught up with the finished writer (it cannot beat the writer; the writer's own rate is
  printed next to it, and the most lines the pane was ever behind);
* the longest gap between two frames of the pane while the log grows (frames: repaints of the
  pane's first row) and the longest stall of the UI loop (a 10 ms timer's worst lateness);
* the process's RSS after the last line;
* then, a fresh viewer opening that whole log: when its last line is on screen, when it is indexed.

Baseline in the same run: Textual's ``Log`` widget fed the same way (new bytes read every 0.1 s,
``write_lines`` in batches of 1,000, ``max_lines`` 10,000 so its memory is bounded), on
``--baseline-lines`` (default 1M) lines.

    python bench/log_ingest.py [--lines 10000000] [--baseline-lines 1000000] [--json]

``--baseline-lines 0`` skips the baseline; ``--json`` prints one JSON object instead of the text (what
``bench/record.py`` reads: the viewer's figures and the fresh open's).

Goals (issue 8, docs/performance.md): >= 100K lines/s, frame gaps <= 100 ms, RSS <= 200 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REL = "stages/x/stage.log"

WRITER = """
import sys, time
path, n = sys.argv[1], int(sys.argv[2])
t0 = time.time()
with open(path, "ab", buffering=0) as fh:
    for b in range(0, n, 10_000):
        fh.write("".join(f"2026-12-02 10:00:00.123 INFO train step {i} loss=1.2345 tok/s=41234.5 lr=3e-4\\n"
                         for i in range(b, min(n, b + 10_000))).encode())
print(t0, time.time())
"""

VIEWER = r"""
import json, os, sys, time
from textual.app import App
from textual.widgets import Log
from console.app import freeze_startup_objects
from console.logindex import LogIndex
from console.screens.logview import LogScreen
from console.transport import LocalTransport
from console.widgets.logview import LogView

root, rel, n, mode, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
frames, lag, samples = [], [0.0], []


def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024


class Bench(App):
    def on_mount(self):
        self.t = LocalTransport(root)
        self.t0 = None
        self.lines = 0
        if mode == "open":
            self.scr = LogScreen(LogIndex(self.t, rel), "bench")
            self.opened = time.time()
            self.shown = None
            self.push_screen(self.scr)
            self.set_interval(0.005, self.watch_open)
            return
        if mode == "index":
            orig = LogView.render_line
            def render_line(view, y):
                if y == 0:
                    frames.append(time.time())
                return orig(view, y)
            LogView.render_line = render_line
            self.scr = LogScreen(LogIndex(self.t, rel), "bench")
            self.push_screen(self.scr)
        else:
            self.log_widget = Log(max_lines=10_000, auto_scroll=True)
            self.mount(self.log_widget)
            orig = Log.render_line
            def render_line(view, y):
                if y == 0:
                    frames.append(time.time())
                return orig(view, y)
            Log.render_line = render_line
            self.offset = 0
            self.set_interval(0.1, self.feed)
        self.expected = time.time() + 0.01
        self.set_interval(0.01, self.tick)
        self.call_after_refresh(freeze_startup_objects)  # as AerieApp does

    def watch_open(self):
        view, ix = self.scr.view, self.scr.index
        if self.shown is None and view.window and view.window[-1].text.split(" step ")[-1].startswith(str(n - 1) + " "):
            self.shown = time.time()
        if self.shown is not None and ix.caught_up:
            json.dump({"open_s": self.shown - self.opened, "indexed_s": time.time() - self.opened,
                       "rss_mb": rss_mb(), "lines": ix.lines}, open(out, "w"))
            self.exit()

    async def feed(self):
        r = (await self.t.read_many([(rel, self.offset)], max_bytes=8 << 20))[0]
        end = r.data.rfind(b"\n") + 1
        if end:
            self.offset += end
            lines = r.data[:end].decode().splitlines()
            for i in range(0, len(lines), 1000):
                self.log_widget.write_lines(lines[i:i + 1000])
            self.lines += len(lines)

    def tick(self):
        now = time.time()
        lag[0] = max(lag[0], now - self.expected)
        self.expected = now + 0.01
        count = self.scr.index.lines if mode == "index" else self.lines
        if count and self.t0 is None:
            self.t0 = now
        if not samples or now - samples[-1][0] >= 0.1:
            samples.append((now, count))
        if count >= n:
            import resource
            ru = resource.getrusage(resource.RUSAGE_SELF)
            json.dump({"t0": self.t0, "t1": now, "lines": count, "frames": frames, "lag_s": lag[0],
                       "rss_mb": rss_mb(), "samples": samples, "cpu_s": ru.ru_utime + ru.ru_stime},
                      open(out, "w"))
            self.exit()


Bench().run(headless=True, size=(140, 40))
"""


def open_existing(tmp: Path, lines: int) -> dict:
    """A fresh viewer on the log the follow run left: how soon its end shows, how soon it is indexed."""
    out = tmp / "open.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "-c", VIEWER, str(tmp / "index"), REL, str(lines), "open", str(out)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=600,
    )
    if p.returncode != 0:
        raise SystemExit(f"open: viewer failed: {p.stderr.decode()[-2000:]}")
    res = json.loads(out.read_text())
    assert res["lines"] == lines, res
    (tmp / "index" / REL).unlink()
    return res


def run(tmp: Path, lines: int, mode: str) -> dict:
    log = tmp / mode / REL
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    out = tmp / f"{mode}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    viewer = subprocess.Popen(
        [sys.executable, "-c", VIEWER, str(tmp / mode), REL, str(lines), mode, str(out)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(3.0)  # imports and the first frame are not what is measured
    writer = subprocess.run(
        [sys.executable, "-c", WRITER, str(log), str(lines)], capture_output=True, text=True, check=True
    )
    w_start, w_end = map(float, writer.stdout.split())
    try:
        viewer.wait(timeout=600)
    except subprocess.TimeoutExpired:
        viewer.kill()
        raise SystemExit(f"{mode}: the viewer did not catch up within 600 s") from None
    if viewer.returncode != 0:
        raise SystemExit(f"{mode}: viewer failed: {viewer.stderr.read().decode()[-2000:]}")
    res = json.loads(out.read_text())
    size = log.stat().st_size
    t0, t1 = w_start, res["t1"]
    frames = [f for f in res["frames"] if t0 <= f <= t1]
    gaps = [b - a for a, b in zip(frames, frames[1:], strict=False)]
    wrate = lines / (w_end - w_start)
    behind = 0
    for t, count in res["samples"]:  # the writer's progress estimated at its mean rate
        if t >= t0:
            behind = max(behind, min(lines, int((t - t0) * wrate)) - count)
    if mode != "index":
        log.unlink()
    return {
        "lines_per_s": res["lines"] / (t1 - t0),
        "writer_lines_per_s": wrate,
        "span_s": t1 - t0,
        "first_ms": 1000 * (frames[0] - t0) if frames else float("nan"),
        "max_gap_ms": 1000 * max(gaps, default=float("nan")),
        "frames": len(frames),
        "p50_gap_ms": 1000 * pct(gaps, 0.5),
        "p99_gap_ms": 1000 * pct(gaps, 0.99),
        "lag_ms": 1000 * res["lag_s"],
        "rss_mb": res["rss_mb"],
        "behind": behind,
        "bytes": size,
        "cpu_s": res["cpu_s"],
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=10_000_000)
    ap.add_argument("--baseline-lines", type=int, default=1_000_000)
    ap.add_argument("--json", action="store_true", help="print one JSON object (bench/record.py reads it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ours = run(tmp, args.lines, "index")
        opened = open_existing(tmp, args.lines)
        base = run(tmp, args.baseline_lines, "log") if args.baseline_lines else None
    if args.json:
        print(json.dumps({"viewer": ours, "open": opened, "baseline": base, "lines": args.lines}))
        return
    for name, r, n in (
        ("log viewer (line index)", ours, args.lines),
        ("baseline: Textual Log", base, args.baseline_lines),
    ):
        if r is None:
            continue
        print(f"{name}: {n:,} lines (~{r['bytes'] / 2**20:.0f} MiB) in {r['span_s']:.2f} s")
        print(
            f"  sustained {r['lines_per_s']:,.0f} lines/s (writer {r['writer_lines_per_s']:,.0f} lines/s, "
            f"at most ~{max(0, r['behind']):,} lines behind)"
        )
        print(
            f"  first frame {r['first_ms']:.0f} ms after the writer started; {r['frames']} frames, gaps between them "
            f"p50 {r['p50_gap_ms']:.0f} / p99 {r['p99_gap_ms']:.0f} / longest {r['max_gap_ms']:.0f} ms; "
            f"longest UI-loop stall {r['lag_ms']:.0f} ms"
        )
        print(
            f"  RSS after the last line {r['rss_mb']:.0f} MB; the viewer process used {r['cpu_s']:.1f} s of CPU "
            "in all (start-up included)"
        )
    print(
        f"opening that {args.lines:,}-line log afresh: its end on screen after {opened['open_s'] * 1000:.0f} ms "
        f"(start-up of the screen included), fully indexed after {opened['indexed_s']:.2f} s, RSS "
        f"{opened['rss_mb']:.0f} MB"
    )
    if base is not None:
        print(f"ratio lines/s viewer / baseline: {ours['lines_per_s'] / base['lines_per_s']:.1f}x")
    print(f"host: {os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
