"""One command for the CPU benchmarks that matter to a user, and a record that catches the next regression.

Runs each benchmark ``--repeats`` times (default 2) as its own process, through the bench script's own
``--json`` output, takes each figure's median and its run-to-run spread (max - min), appends one JSON line
(commit, UTC date, machine, figures, load average) to ``bench/record.jsonl``, and prints each figure next
to the best and the last recorded one on a comparable machine (same CPU model and core count), flagging
WORSE any that moved the wrong way by more than the spread (``bench/record_store.py`` holds that logic).

    python bench/record.py                       # every benchmark; the demo alone takes minutes
    python bench/record.py --quick               # all but the demo
    python bench/record.py --only console,prep   # or --skip demo,log_ingest
    python bench/record.py --fail-on-worse       # exit 1 when a figure got worse
    python bench/record.py --table-md [--write-docs]   # the record as markdown (into docs/performance.md)

A run that appends to the repo's own record also rewrites the table at the top of docs/performance.md.

Benchmarks: console (bench/console_idle.py: attached to 12 live stages and to a finished run), alerts
(bench/alerts_cost.py: the supervisor's alert rules on the reference plan), log_ingest,
plot_render, prep, event_rotation (a raw 100 MiB event line), supervisor_scale (1K and 10K stages), launches
(the CPU of one launch), shard_write (into /dev/shm when it exists: the writer, not the disk), demo (the README's
``aerie demo --headless``: wall time and the draft's accept length).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record_store as rs  # noqa: E402

RECORD = ROOT / "bench" / "record.jsonl"
DOCS = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- record:begin (python bench/record.py --table-md --write-docs) -->", "<!-- record:end -->"


@dataclass(frozen=True)
class Spec:
    """One figure a benchmark yields: where it is in the script's JSON, its unit, which way is better."""

    name: str
    unit: str
    better: str
    pick: Callable[[dict[str, Any]], float]
    floor: float = 0.0


@dataclass(frozen=True)
class Bench:
    name: str
    run: Callable[[], dict[str, Any]]  # one run: the script's JSON
    figures: tuple[Spec, ...]
    about: str


def script(name: str, *args: str, timeout: float = 900) -> Callable[[], dict[str, Any]]:
    """Run ``bench/NAME --json ARGS`` in its own process; its last stdout line is the JSON."""

    def run() -> dict[str, Any]:
        cmd = [sys.executable, str(ROOT / "bench" / name), *args, "--json"]
        p = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{' '.join(cmd[1:])} exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}")
        return dict(json.loads(lines[-1]))

    return run


DEMO_TIMEOUT_S = 3600  # ~5 min alone on 2 cores, 25 min measured at load 4-8 (docs/performance.md)


def demo() -> dict[str, Any]:
    """The README's first command without the UI, timed; the bench stage's accept length from its results.

    The run's stages run detached from the ``aerie demo`` watcher, so on a timeout the stages still running
    are killed through ``aerie kill`` (their own process groups) before the temporary run dir goes."""
    with tempfile.TemporaryDirectory(prefix="aerie-record-demo-") as d:
        run_dir = Path(d) / "demo"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("OMP_NUM_THREADS", None)  # as a user runs it
        cli = [sys.executable, "-m", "console.cli"]
        t0 = time.monotonic()
        p = subprocess.Popen(
            [*cli, "demo", "--headless", "--run-dir", str(run_dir)],
            cwd=d,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = p.communicate(timeout=DEMO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            stop_demo(cli, run_dir, env)
            raise RuntimeError(f"aerie demo --headless did not finish within {DEMO_TIMEOUT_S} s") from None
        wall = time.monotonic() - t0
        if p.returncode != 0:
            raise RuntimeError(f"aerie demo --headless exited {p.returncode}: {out[-1500:]}")
        res = json.loads((run_dir / "stages" / "bench" / "out" / "results.json").read_text())
        return {"wall_s": wall, "accept_len": res["accept_len"]}


def stop_demo(cli: list[str], run_dir: Path, env: dict[str, str]) -> None:
    """Kill the demo's running stages with ``aerie kill`` and give its supervisor a minute to wind down."""
    state_path = run_dir / "state.json"
    for _ in range(60):
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            return
        if state.get("done"):
            return
        for st in state.get("stages", []):
            if st.get("state") == "running":
                subprocess.run(
                    [*cli, "kill", str(run_dir), st["id"]], env=env, capture_output=True, timeout=60
                )
        time.sleep(1.0)


SHM = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
BENCHES = (
    Bench(
        "console",
        script("console_idle.py", "--seconds", "30"),
        (
            Spec("console_live_pct", "% of a core", "lower", lambda j: j["live_pct"], floor=0.1),
            Spec("console_at_rest_pct", "% of a core", "lower", lambda j: j["finished_pct"], floor=0.1),
        ),
        "the console's CPU attached to 12 live stages and to a finished run (30 s each)",
    ),
    Bench(
        "log_ingest",
        script("log_ingest.py", "--lines", "10000000", "--baseline-lines", "0"),
        (
            Spec("log_lines_per_s", "lines/s", "higher", lambda j: j["viewer"]["lines_per_s"]),
            Spec("log_max_frame_gap_ms", "ms", "lower", lambda j: j["viewer"]["max_gap_ms"], floor=20),
            Spec("log_rss_mb", "MB", "lower", lambda j: j["viewer"]["rss_mb"]),
            Spec("log_open_10m_ms", "ms", "lower", lambda j: 1000 * j["open"]["open_s"], floor=20),
        ),
        "the log pane following a 10M-line log written at full speed, then opening it afresh",
    ),
    Bench(
        "plot_render",
        script("plot_render.py", "--repeat", "20"),
        (
            Spec("plot_detail_ms", "ms", "lower", lambda j: j["detail_ms"]),
            Spec("plot_metrics_ms", "ms", "lower", lambda j: j["metrics_ms"]),
        ),
        "one Plotext build of the detail pane's curves and of the metrics view",
    ),
    Bench(
        "prep",
        script("prep.py", "--rows", "150"),
        (Spec("prep_rows_per_s", "rows/s", "higher", lambda j: j["rows_per_s"]),),
        "the prep stage's rows/s on 450 rows of three kinds (the naive loop is not run)",
    ),
    Bench(
        "shard_write",
        script("shard_write.py", "--out-dir", SHM, "--batches", "4", "--modes", "2:4"),
        (
            Spec("shard_sink_gbps", "GB/s", "higher", lambda j: next(iter(j["sink_gbps"].values()))),
            Spec(
                "shard_sink_share_of_raw",
                "%",
                "higher",
                lambda j: 100 * next(iter(j["sink_gbps"].values())) / j["raw_gbps"],
            ),
        ),
        f"the extract stage's shard writer, 2.1 GB into {SHM}, and its share of bare os.pwrite",
    ),
    Bench(
        "event_rotation",
        script("event_rotation.py", "--sizes", "100"),
        (
            Spec("event_rotate_100mib_ms", "ms", "lower", lambda j: j["sizes"]["100"]["rotate_ms"], floor=20),
            Spec("event_next_wait_ms", "ms", "lower", lambda j: j["sizes"]["100"]["next_wait_ms"], floor=20),
        ),
        "rotating an events file holding a raw 100 MiB line, and the other writer's wait for its next event",
    ),
    Bench(
        "supervisor_scale",
        script("supervisor_scale.py", "--sizes", "1000,10000", "--seconds", "20"),
        (
            Spec(
                "sup_10k_held_cpu_pct",
                "% of a core",
                "lower",
                lambda j: j["sizes"]["10000"]["cpu_pct"],
                floor=1,
            ),
            Spec(
                "sup_10k_snapshot_max_s",
                "s",
                "lower",
                lambda j: j["sizes"]["10000"]["snapshot_max_s"],
                floor=0.5,
            ),
            Spec("sup_10k_control_s", "s", "lower", lambda j: j["sizes"]["10000"]["control_s"], floor=0.2),
            Spec(
                "sup_10k_launches_per_s",
                "launches/s",
                "higher",
                lambda j: j["sizes"]["10000"]["launches_per_s"],
            ),
            Spec(
                "sup_1k_held_cpu_pct",
                "% of a core",
                "lower",
                lambda j: j["sizes"]["1000"]["cpu_pct"],
                floor=1,
            ),
        ),
        "a real supervisor on 1,000 and 10,000 ready stages held by 2 CPU slots: CPU, snapshots, control, launches",
    ),
    Bench(
        "launches",
        script("launch_cost.py", "--repeat", "40", "--json"),
        (
            Spec("launch_cpu_ms", "ms", "lower", lambda j: j["launch_ms"], floor=5),
            Spec("launch_launcher_ms", "ms", "lower", lambda j: j["launcher_ms"], floor=5),
            Spec("launch_log_writer_ms", "ms", "lower", lambda j: j["log_writer_ms"], floor=3),
        ),
        "the CPU one stage launch costs: its launcher's whole attempt of `true` and its log writer (min of 40)",
    ),
    Bench(
        "alerts",
        script("alerts_cost.py", "--scales", "1,10", "--cycles", "200"),
        (
            Spec(
                "alerts_busy_pct", "% of a core", "lower", lambda j: j["busy"]["1"]["pct_of_core"], floor=0.02
            ),
            Spec(
                "alerts_idle_pct", "% of a core", "lower", lambda j: j["idle"]["1"]["pct_of_core"], floor=0.02
            ),
            Spec(
                "alerts_us_per_stage_280", "µs", "lower", lambda j: j["busy"]["10"]["us_per_stage"], floor=5
            ),
        ),
        "the alert rules in the supervisor on the 28-stage reference plan (every stage writing), and per stage at ×10",
    ),
    Bench(
        "demo",
        demo,
        (
            Spec("demo_wall_s", "s", "lower", lambda j: j["wall_s"]),
            Spec("demo_accept_len", "tokens/pass", "higher", lambda j: j["accept_len"], floor=0.05),
        ),
        "aerie demo --headless: the whole pipeline on the bundled data, and the draft's accept length",
    ),
)
BY_NAME = {b.name: b for b in BENCHES}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def commit_id() -> str:
    """HEAD, with ``+dirty`` when tracked files differ from it, aside from the two files a run itself
    writes (the record and the docs page holding its table)."""
    try:
        head = git("rev-parse", "HEAD")
        mine = (f":(exclude){p.relative_to(ROOT)}" for p in (RECORD, DOCS))
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *mine)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # not a git checkout: the record still says when and where
    return head + ("+dirty" if changed else "")


def commits_since(commit: str) -> int | None:
    try:
        return int(git("rev-list", "--count", f"{commit}..HEAD"))
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def machine() -> rs.Machine:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return rs.Machine(socket.gethostname(), cpu, os.cpu_count() or 0, platform.python_version(), torch)


def names(arg: str | None, flag: str) -> list[str]:
    if not arg:
        return []
    out = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in out if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"{flag}: unknown benchmark {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    return out


def selected(args: argparse.Namespace) -> list[Bench]:
    only, skip = names(args.only, "--only"), names(args.skip, "--skip")
    if args.quick:
        skip.append("demo")
    return [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]


def measure(bench: Bench, repeats: int) -> list[rs.Figure]:
    """Run the benchmark ``repeats`` times back to back; each figure is the median of its samples."""
    samples: dict[str, list[float]] = {s.name: [] for s in bench.figures}
    for i in range(repeats):
        t0 = time.monotonic()
        print(f"  {bench.name} {i + 1}/{repeats} …", end="", file=sys.stderr, flush=True)
        try:
            out = bench.run()
            picked = {s.name: s.pick(out) for s in bench.figures}
        except (RuntimeError, KeyError, ValueError, OSError) as e:
            raise RuntimeError(f"run {i + 1}/{repeats}: {e} (earlier runs: {samples})") from e
        for name, v in picked.items():
            samples[name].append(v)
        print(f" {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return [rs.figure_from_samples(s.name, s.unit, s.better, samples[s.name], s.floor) for s in bench.figures]


def reproduce_command(figure: str) -> str | None:
    """The one command that measures ``figure`` again (and records it): its benchmark alone."""
    for b in BENCHES:
        if any(s.name == figure for s in b.figures):
            return f"python bench/record.py --only {b.name}"
    return None


def table_md_main(args: argparse.Namespace) -> int:
    block = rs.table_md(
        rs.read_records(args.record),
        datetime.now(UTC),
        commits_since,
        args.stale_commits,
        args.stale_days,
        reproduce_command,
    )
    if not args.write_docs:
        print(block, end="")
        return 0
    DOCS.write_text(rs.replace_between(DOCS.read_text(), block, BEGIN, END, str(DOCS)))
    print(f"wrote the record's table into {DOCS.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated benchmarks to run: " + ",".join(BY_NAME))
    ap.add_argument("--skip", help="comma-separated benchmarks not to run")
    ap.add_argument("--quick", action="store_true", help="skip the demo (it takes minutes)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each benchmark (at least 2: the spread)")
    ap.add_argument(
        "--record", type=Path, default=RECORD, help="the record file (default bench/record.jsonl)"
    )
    ap.add_argument("--no-record", action="store_true", help="compare and print, append nothing")
    ap.add_argument("--fail-on-worse", action="store_true", help="exit 1 when a figure got worse")
    ap.add_argument("--rel-floor", type=float, default=rs.REL_FLOOR, help="smallest relative change flagged")
    ap.add_argument("--table-md", action="store_true", help="print the record's latest figures as markdown")
    ap.add_argument(
        "--write-docs", action="store_true", help="with --table-md: write it into docs/performance.md"
    )
    ap.add_argument("--stale-commits", type=int, default=50)
    ap.add_argument("--stale-days", type=float, default=14)
    args = ap.parse_args(argv)
    try:
        if args.table_md:
            return table_md_main(args)
        if args.repeats < 2:
            raise SystemExit(
                "--repeats must be at least 2: the spread between runs is what tells noise from change"
            )
        history = rs.read_records(args.record)  # a broken record fails now, not after the benchmarks
    except rs.RecordError as e:
        raise SystemExit(f"record: {e}") from None
    benches = selected(args)
    if not benches:
        raise SystemExit("nothing to run (--only/--skip/--quick left no benchmark)")
    commit, load0 = commit_id(), os.getloadavg()
    print(f"record: {', '.join(b.name for b in benches)} x {args.repeats} at {commit[:12]}", file=sys.stderr)
    figures: dict[str, rs.Figure] = {}
    failed: dict[str, str] = {}
    for b in benches:
        try:
            figures.update((f.name, f) for f in measure(b, args.repeats))
        except (RuntimeError, subprocess.TimeoutExpired, rs.RecordError) as e:
            print(f" failed: {e}", file=sys.stderr)
            failed[b.name] = str(e)[-500:]
    extra: dict[str, Any] = {
        "repeats": args.repeats,
        "benchmarks": [b.name for b in benches],
        "load_avg": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "command": " ".join(["python bench/record.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    if failed:
        extra["failed"] = failed
    rec = rs.Record(commit, datetime.now(UTC).isoformat(timespec="seconds"), machine(), figures, extra)
    rows = rs.compare(rec, history, args.rel_floor)
    print(f"\n{rec.machine.short()}; load average {extra['load_avg'][0]} → {extra['load_avg'][1]}")
    print(rs.format_table(rows))
    if figures and not args.no_record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        with args.record.open("a") as fh:
            fh.write(rs.record_line(rec) + "\n")
        print(f"appended to {args.record}")
        if args.record.resolve() == RECORD.resolve():  # the repo's record: its docs table follows it
            table_md_main(argparse.Namespace(**{**vars(args), "write_docs": True}))
    for name, why in failed.items():
        print(f"FAILED {name}: {why}")
    worse = rs.regressions(rows)
    if worse:
        print(f"WORSE: {', '.join(r.figure.name for r in worse)}")
    if failed:
        return 2
    return 1 if worse and args.fail_on_worse else 0


if __name__ == "__main__":
    raise SystemExit(main())
