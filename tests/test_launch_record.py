"""The launcher starts what the supervisor decided: the stage in this attempt's ``launch.json`` (so no launcher
imports the plan), or ``spec.json`` when the record predates those fields (an older supervisor, mid-upgrade);
a stage that cannot be started is recorded failed with what ``exec`` said, and the launcher's own start stays
free of the plan's modules."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.run.hosts.local_exec import LAUNCHER_SCRIPT
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from pipeline.run.supervise.run_setup import create_run

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, command: str) -> tuple[RunDir, plan_mod.Plan]:
    (tmp_path / "plan.toml").write_text(f'[run]\nname = "lr"\n[[stage]]\nid = "a"\ncommand = "{command}"\n')
    plan = plan_mod.load(tmp_path / "plan.toml", run_dir=tmp_path / "run")
    return create_run(plan, tmp_path / "run"), plan


def _launch(run: RunDir, attempt: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, "-S", LAUNCHER_SCRIPT, str(run.root), "a", str(attempt)],
        env=env,
        cwd=run.root,
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=60,
    )
    return read_json(run.stage("a").exit)


def test_the_launcher_runs_the_stage_its_launch_record_names_not_the_plan(tmp_path: Path) -> None:
    run, plan = _run(tmp_path, "echo from-plan > $AERIE_OUT/said")
    fields = plan.stages[0].launch_fields() | {"command": "echo from-record > $AERIE_OUT/said"}
    write_json(run.stage("a").launch, {"attempt": 1, "t": time.time(), "stage": fields})
    ex = _launch(run)
    assert ex["returncode"] == 0 and ex["attempt"] == 1
    assert (run.stage("a").out / "said").read_text() == "from-record\n"


def test_an_older_launch_record_without_the_stage_falls_back_to_spec_json(tmp_path: Path) -> None:
    run, _plan = _run(tmp_path, "echo from-plan > $AERIE_OUT/said")
    write_json(run.stage("a").launch, {"attempt": 1, "t": time.time(), "supervisor": 1})  # as before issue 46
    assert _launch(run)["returncode"] == 0
    assert (run.stage("a").out / "said").read_text() == "from-plan\n"
    # a record of another attempt is not this one's: the plan's stage runs
    fields = _plan.stages[0].launch_fields() | {"command": "echo stale > $AERIE_OUT/said"}
    write_json(run.stage("a").launch, {"attempt": 1, "t": time.time(), "stage": fields})
    assert _launch(run, attempt=2)["returncode"] == 0
    assert (run.stage("a").out / "said").read_text() == "from-plan\n"


def test_a_stage_that_cannot_be_started_is_failed_naming_what_exec_said(tmp_path: Path) -> None:
    run, plan = _run(tmp_path, "true")
    fields = plan.stages[0].launch_fields() | {"module": "pipeline.stages.prep"}
    write_json(run.stage("a").launch, {"attempt": 1, "t": time.time(), "stage": fields})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    missing = str(tmp_path / "no-such-python")
    code = f"import sys; sys.executable = {missing!r}; sys.argv = ['x', {str(run.root)!r}, 'a', '1']; "
    code += f"exec(compile(open({LAUNCHER_SCRIPT!r}).read(), 'launcher', 'exec'), {{'__name__': '__main__'}})"
    subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, cwd=run.root, stdout=subprocess.DEVNULL, timeout=60
    )
    ex = read_json(run.stage("a").exit)
    assert ex["returncode"] == 127
    assert "No such file or directory" in ex["detail"] and missing in ex["detail"]


def test_the_launchers_start_imports_nothing_of_the_plan_or_subprocess(tmp_path: Path) -> None:
    """What every launch pays for: the plan's modules and ``subprocess`` stay out of a launcher's start."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pipeline.run.stage_side.launcher; "
    code += "print(sorted(n for n in sys.modules if n.startswith('pipeline.run.plan') or n == 'subprocess'))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == "[]", out.stdout
