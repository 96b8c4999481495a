"""The README's picture: the console on the real demo run, saved as an SVG (``docs/console.svg``).

``python docs/screenshot.py [OUT.svg] [--size 120x36] [--timeout 240]`` starts the demo run (``aerie demo``'s
plan, the real pipeline on the bundled data) in a temporary directory, waits until it has something to show —
its regenerations running against the inference server, or the timeout — opens the console on it headless (Textual's
``run_test``), lets it select the stage most worth a look, and saves ``app.save_screenshot()``'s SVG — or fails
(exit 1, nothing written) when the console selected no stage ("Select a stage" on screen). Then it
stops what it started: the supervisor and each stage's recorded attempt (never by name), and removes the run.

``tests/test_docs_screenshot.py`` regenerates it and compares its structure and words (the board's columns and
stage ids, the footer's keys) with the committed one, not its pixels: rerun this when the console's look changes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from console.app import AerieApp  # noqa: E402
from console.cli import demo_plan_path  # noqa: E402
from console.transport import LocalTransport, start_local_run  # noqa: E402
from console.widgets.board import StageBoard  # noqa: E402
from console.widgets.detail import StageDetail  # noqa: E402
from pipeline.run.hosts.procs import ProcIdentity, StrangerError, signal_attempt, signal_group  # noqa: E402
from pipeline.run.rundir.layout import RunDir, read_json  # noqa: E402

OUT = ROOT / "docs" / "console.svg"


def states(run: RunDir) -> dict[str, str]:
    return {s["id"]: s["state"] for s in (read_json(run.state_path) or {}).get("stages", [])}


def wait_for_a_picture(run: RunDir, timeout_s: float) -> None:
    """Until the regenerations run against the inference server (the board then shows done, running, a
    service and waiting rows), or the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = (read_json(run.state_path) or {}).get("stages", [])
        if any(r["id"].startswith("regen.") and (r.get("progress") or {}).get("done") for r in rows):
            return  # a regeneration has answers: its row has progress, a rate, an ETA
        time.sleep(1.0)


async def shoot(run: RunDir, out: Path, size: tuple[int, int]) -> None:
    app = AerieApp(LocalTransport(str(run.root)), poll_s=0.5, alerts=False, user_config={})
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (app.model.loaded and app.model.telemetry.disk is not None):
            await pilot.pause(0.2)
        await pilot.pause(3.0)  # a few polls: rates, the selected stage's log tail
        problem = no_selection(app)
        if problem:
            raise NoPicture(problem)
        app.save_screenshot(filename=out.name, path=str(out.parent))


class NoPicture(RuntimeError):
    """The console is not worth a picture (it selected no stage): the README would show an empty pane."""


def no_selection(app: AerieApp) -> str | None:
    """Why the screen is no picture of the console at work: no stage selected on the board, or the detail
    pane's "Select a stage" (issue 47 item 8: the demo's first screen selected nothing for minutes)."""
    board, detail = app.query_one(StageBoard), app.query_one(StageDetail)
    shown = app.export_screenshot().replace("&#160;", " ")
    if board.selected_key is None or detail.stage_id is None or "Select a stage" in shown:
        return (
            "the console selected no stage (its detail pane says 'Select a stage'): a first screen that "
            "selects nothing is a bug, not a picture; no screenshot written"
        )
    return None


def stop(run: RunDir) -> None:
    """The supervisor first (so it starts nothing more), then each stage's recorded attempt."""
    rec = read_json(run.supervisor_path)
    if rec:
        with contextlib.suppress(StrangerError, PermissionError, ProcessLookupError):
            signal_group(ProcIdentity.from_dict(rec), signal.SIGTERM)
    time.sleep(1.0)
    for sid in run.stage_ids():
        proc = read_json(run.stage(sid).proc)
        if proc:
            with contextlib.suppress(StrangerError, PermissionError, ProcessLookupError):
                signal_attempt(ProcIdentity.from_dict(proc), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=OUT)
    ap.add_argument("--size", default="120x36", help="columns x rows")
    ap.add_argument("--timeout", type=float, default=360.0, help="seconds to wait for the demo to get going")
    args = ap.parse_args(argv)
    cols, rows = (int(x) for x in args.size.split("x"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="aerie-shot-"))
    run_dir = tmp / "demo"
    rc, out, err = start_local_run(demo_plan_path(), run_dir)
    if rc != 0:
        print(f"screenshot: the demo did not start: {err}", file=sys.stderr)
        return 1
    run = RunDir(run_dir)
    try:
        wait_for_a_picture(run, args.timeout)
        asyncio.run(shoot(run, args.out.resolve(), (cols, rows)))
        shown = states(run)
    except NoPicture as exc:
        print(f"screenshot: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(run)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"screenshot: {args.out} ({cols}x{rows}; the stages then: {shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
