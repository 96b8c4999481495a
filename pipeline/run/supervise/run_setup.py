"""Setting a run up: its run directory created from the plan (or re-opened), the built-in target model checked,
and its supervisor started detached or found alive (by its lock: :mod:`.liveness`). Used by the supervisor's CLI, ``ctl`` and the
console's transports; the supervisor itself (:mod:`.supervisor`) only runs the loop.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.run.hosts.procs import env_with_pipeline
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import Plan
from pipeline.run.rundir.files import PRIVATE_DIR, open_private_append, private_dir
from pipeline.run.rundir.layout import RunDir, write_atomic, write_json
from pipeline.run.supervise.liveness import lock_held


class SupervisorError(RuntimeError):
    pass


def create_run(plan: Plan, run_dir: Path | None = None) -> RunDir:
    """Create (or re-open) the run directory for ``plan``; refuses a dir holding another plan."""
    run = RunDir(run_dir or plan.run_dir)
    text = plan.path.read_text()
    if run.plan_path.exists():
        if run.plan_path.read_text() != text:
            raise SupervisorError(
                f"{run.root} already holds a different plan; attach to it (aerie attach {run.root}) "
                "or choose a new run directory"
            )
        return run
    private_dir(run.root)
    with contextlib.suppress(PermissionError):  # not ours to change: its owner decides who may read it
        os.chmod(run.root, PRIVATE_DIR)  # the run's logs and events are its operator's, whoever made the dir
    for spec in plan.stages:
        sd = run.stage(spec.id)
        private_dir(sd.path)
        write_json(sd.spec, spec.to_dict())
        if not sd.attempt_file.exists():
            write_json(sd.attempt_file, {"attempt": 1, "t": time.time()})
    write_json(run.root / "order.json", plan.order())
    write_json(
        run.root / "plan-origin.json",
        {"base": str(plan.path.parent.absolute()), "path": str(plan.path.absolute())},
    )
    # The plan goes last: its presence marks a complete run dir.
    write_atomic(run.plan_path, text)
    return run


def spawn_detached(run_root: Path, python: str = sys.executable) -> int:
    """Start ``python -m pipeline.run.supervise.supervisor RUN`` in its own session; returns its pid."""
    run = RunDir(run_root)
    try:
        logfh = open_private_append(run.supervisor_log)
    except OSError:  # a run dir that cannot be written still gets its supervisor (it says why in state)
        logfh = open(os.devnull, "ab")  # noqa: SIM115
    with logfh:
        p = subprocess.Popen(
            [python, "-m", "pipeline.run.supervise.supervisor", str(run.root)],
            stdin=subprocess.DEVNULL,
            stdout=logfh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(run.root),
            env=env_with_pipeline(),
        )
    return p.pid


def supervisor_alive(run: RunDir) -> bool:
    """True when a supervisor holds the run's lock (an flock on the run directory; deleting
    ``supervisor.lock`` or ``supervisor.json`` changes nothing). :func:`.liveness.liveness` says more:
    its pid, whether it still writes its snapshot."""
    return lock_held(run.root)


class ModelMissing(RuntimeError):
    """The plan's built-in target model is not installed on this host."""


def check_model(plan: plan_mod.Plan) -> None:
    """Before any stage starts: a built-in target model (the demo's) must be installed here."""
    model = plan.target.model
    if not isinstance(model, str) or not model.startswith("builtin:"):
        return
    from pipeline.run.plan.builtin_models import ModelAssetError, check_available

    try:
        check_available(model)
    except ModelAssetError as exc:
        raise ModelMissing(f"target.model {model}: {exc}") from None
