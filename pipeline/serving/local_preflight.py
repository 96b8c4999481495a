"""``aerie preflight`` for a local plan: ``python -m pipeline.serving.local_preflight PLAN``, on this machine.

The local executor runs the stages with this interpreter, so what it finds here is what the stages will find.
For a plan that runs SGLang (a serve stage with ``backend = "sglang"``, or ``[target] engine = "sglang"``) it
checks, as the SSH preflight does on its host, the installed SGLang against the tested-versions table
(:func:`pipeline.tested_versions.plan_sglang`: present, its release, the torch and transformers beside it), and,
where SGLang is missing, whether this Python can install the GPU lock at all (CPython 3.12 only). A plan that runs
no SGLang has nothing to check here and says so.

Exit 0 when every check passed, 2 otherwise. Standard library only.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from pipeline import tested_versions as tv
from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import Plan


def preflight(plan: Plan, version_of: Callable[[str], str | None] | None = None) -> CheckReport:
    """The checks of a local plan with this interpreter (``version_of``: installed versions, for tests)."""
    rep = CheckReport(title=f"preflight of {plan.path} on this machine ({sys.executable}):")
    v = tv.plan_sglang(plan, version_of)
    if v is None:
        rep.add("sglang", True, "the plan runs no SGLang stage: nothing to check here")
        return rep
    uses = ", ".join(sorted(tv.sglang_uses(plan)))
    if v.level == "absent":
        rep.add("sglang", False, f"{plan.path}: the plan runs SGLang ({uses}) but {v.detail}")
        problem = tv.gpu_python_problem(sys.version_info[:3], platform.python_implementation().lower())
        if problem:
            rep.add("python", False, problem)
        return rep
    rep.add("sglang", v.ok, v.detail if v.ok else f"{plan.path}: {v.detail}", warning=v.warning)
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.serving.local_preflight", description=__doc__.split("\n")[0]
    )
    ap.add_argument("plan", type=Path)
    args = ap.parse_args(argv)
    try:
        plan = plan_mod.load(args.plan)
    except plan_mod.PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = preflight(plan)
    print("\n".join(report.lines()))
    print("ready: the run can start" if report.ok else "not ready: fix the FAIL lines above")
    return 0 if report.ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
