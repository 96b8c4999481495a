"""The deep check's lines about what will be served (``aerie plan check --deep``, :mod:`.chain_check`): the installed
SGLang against the tested-versions table, and a deploy draft already on disk against the target it will serve."""

from __future__ import annotations

from pathlib import Path

from pipeline import tested_versions
from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan.dag import Plan


def sglang_line(plan: Plan, rep: CheckReport) -> None:
    """The installed SGLang against the tested-versions table, for a plan that runs SGLang (serve or capture):
    tested passes, untested warns, known broken for what the plan uses fails (``pipeline/tested_versions.py``)."""
    uses = tested_versions.sglang_uses(plan)
    if not uses:
        return
    v = tested_versions.classify_sglang(uses)
    detail = v.detail
    if v.level == "absent":
        detail += "; the host that runs the stages needs it (aerie preflight checks it there)"
    rep.add("sglang", v.ok, detail if v.ok else f"{plan.path}: {detail}", warning=v.warning)


def draft_line(plan: Plan, rep: CheckReport) -> None:
    """``[deploy] draft_model_path``, when it is already on disk, against the target the plan serves: the draft's
    provenance must name this target's config and tokenizer (:mod:`pipeline.eagle3.provenance`)."""
    from pipeline.eagle3 import provenance

    path = plan.settings.deploy.draft_model_path
    if not path or not Path(path).expanduser().is_dir():
        return  # written by this run's train stage later (or not a local path): the serve stage checks it then
    served = str(plan.settings.serve.model or plan.target.model or "")
    v = provenance.check(Path(path).expanduser(), served)
    rep.add(
        "draft provenance",
        v.ok,
        v.detail if v.ok else f"{plan.path}: deploy.draft_model_path: {v.detail}",
        warning=v.level == "warn",
    )
