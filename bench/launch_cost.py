"""Benchmark: the CPU one stage launch costs the host, process by process.

A launch starts two Python processes, as the local executor starts them (by path, without ``site``): the launcher
(``python -S …/stage_side/launcher.py RUN STAGE ATTEMPT``, which records ``proc.json``, writes the ``started``
event and runs the stage) and the stage's log writer (``python -S …/stage_side/log_writer.py LOG``). On a host whose cores are busy, a burst of
launches is bound by their CPU, so this is what "launches a second" (``bench/supervisor_scale.py``) comes down to.

Measured here, each ``--repeat`` times (the minimum is printed: the cost without the noise of a shared host),
as the user + system CPU of the process and its children (``getrusage``):

* ``bare`` — ``python -S -c pass``: the interpreter's own start, the floor of any Python process;
* ``launcher`` — a whole attempt of a stage running ``true`` (its launch record written as the supervisor
  writes it), from start to ``exit.json``;
* ``log_writer`` — a log writer copying an empty stdin to a ``stage.log``.

    python bench/launch_cost.py [--repeat 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.hosts.local_exec import LAUNCHER_SCRIPT, LOG_WRITER_SCRIPT  # noqa: E402
from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.rundir.layout import RunDir, write_json  # noqa: E402
from pipeline.run.supervise.run_setup import create_run  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def cpu_ms(argv: list[str], **kw: object) -> float:
    """User + system CPU of ``argv`` and everything it waited for, in ms. Run in ``/`` as the supervisor runs
    them in the run directory: ``-m`` looks in the working directory first, and a checkout there would win."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, env=ENV, cwd="/", **kw)  # type: ignore[call-overload]
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1000 * (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)


def make_run(tmp: Path, n: int) -> RunDir:
    body = '[run]\nname = "launch"\ndir = "run"\n' + "".join(
        f'[[stage]]\nid = "s{i:03d}"\ncommand = "true"\n' for i in range(n)
    )
    (tmp / "plan.toml").write_text(body)
    plan = plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run")
    run = create_run(plan, tmp / "run")
    for spec in plan.stages:
        fields = spec.launch_fields()
        write_json(run.stage(spec.id).launch, {"attempt": 1, "t": time.time(), "stage": fields})
    return run


def measure(repeat: int) -> dict[str, float]:
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="aerie-launch-") as tmp:
        run = make_run(Path(tmp), repeat)
        bare = [cpu_ms([py, "-S", "-c", "pass"]) for _ in range(repeat)]
        launcher = [
            cpu_ms(
                [py, "-S", LAUNCHER_SCRIPT, str(run.root), f"s{i:03d}", "1"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(repeat)
        ]
        log = Path(tmp) / "stage.log"
        writer = [
            cpu_ms([py, "-S", LOG_WRITER_SCRIPT, str(log)], stdin=subprocess.DEVNULL) for _ in range(repeat)
        ]
    return {"bare_ms": min(bare), "launcher_ms": min(launcher), "log_writer_ms": min(writer)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = measure(args.repeat)
    r["launch_ms"] = r["launcher_ms"] + r["log_writer_ms"]
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"a launch: {r['launch_ms']:.1f} ms of CPU = launcher {r['launcher_ms']:.1f} ms + log writer "
            f"{r['log_writer_ms']:.1f} ms (a bare `python -S` start: {r['bare_ms']:.1f} ms) · at most "
            f"{2000 / r['launch_ms']:.0f} launches/s on 2 free cores"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
