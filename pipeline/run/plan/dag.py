"""The plan: a TOML file describing one run, loaded, validated and expanded into a stage DAG.

A plan names where the run executes, its run directory, the target model, the datasets and the
stages (the ``[executor]`` and ``[[datasets]]`` tables: :mod:`.plan_tables`; ``[[stage]]`` and the DAG:
:mod:`.stages`; every settings table: :mod:`.sections`). A ``[[stage]]`` entry is either a
built-in stage named by its short name (``run = "prep"``;
:data:`BUILTIN_STAGES` maps it to its ``pipeline.stages`` module) or an operator shell command (``command = "..."``); ``for_each = "dataset"`` expands one entry into
one stage per dataset (``prep.ultrachat`` ...), optionally filtered with ``when = {kind = ...}``.
Dependencies (``after``) may use ``{dataset}`` and globs (``"prep.*"``). ``uses`` names service
stages (an inference server) that must be *ready* while the stage runs; a stage that is ``after``
a service waits until the service has been stopped.

Every error names the plan file and the key (``stage[3].after``), so a typo never costs an hour.
This module needs only the standard library: it runs on the container and in the console.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run.plan.schema import PlanError, check_text, check_type
from pipeline.run.plan.schema import key_name as _key
from pipeline.run.plan.sections import SECTIONS, PlanSettings, ResourcesSection, TargetSection
from pipeline.run.plan.stages import (
    BUILTIN_STAGES,
    RetryPolicy,
    StageSpec,
    stage_module,
    stages_from,
    topo_order,
)
from pipeline.run.plan.tables import (
    DATASET_KINDS,
    EXECUTOR_KINDS,
    Dataset,
    DatasetOptions,
    Executor,
    RunSection,
    datasets_from,
)

# The plan's parts live in their own modules; these names are the plan's public surface.
__all__ = [
    "BUILTIN_STAGES",
    "CORE_KEYS",
    "DATASET_KINDS",
    "EXECUTOR_KINDS",
    "SECTION_KEYS",
    "Dataset",
    "DatasetOptions",
    "Executor",
    "Plan",
    "PlanError",
    "RetryPolicy",
    "StageSpec",
    "from_dict",
    "load",
    "render_dag",
    "stage_module",
    "topo_order",
]
_type, _text = check_type, check_text

CORE_KEYS = {"run", "executor", "datasets", "stage"}
# Every other top-level table is a typed settings section (pipeline/run/plan/sections.py).
SECTION_KEYS = set(SECTIONS)


@dataclass
class Plan:
    path: Path
    name: str
    run_dir: Path
    executor: Executor
    cpu_slots: int
    gpus: tuple[int, ...]
    datasets: list[Dataset]
    stages: list[StageSpec]
    settings: PlanSettings
    raw: dict[str, Any]

    @property
    def target(self) -> TargetSection:
        return self.settings.target

    @property
    def resources(self) -> ResourcesSection:
        return self.settings.resources

    def stage(self, stage_id: str) -> StageSpec:
        for s in self.stages:
            if s.id == stage_id:
                return s
        raise KeyError(stage_id)

    def template_kwargs(self, dataset: str | None = None) -> dict[str, Any]:
        """Chat-template variables for a dataset's rows: ``[prep] template_kwargs``, and ``thinking`` from the
        dataset's ``options.thinking`` where set (unset: the template's own default, Kimi-K2.5's is on)."""
        kw = dict(self.settings.prep.template_kwargs)
        if dataset is not None and "thinking" in self.dataset(dataset).options:
            kw["thinking"] = bool(self.dataset(dataset).options["thinking"])
        return kw

    def dataset(self, name: str) -> Dataset:
        for d in self.datasets:
            if d.name == name:
                return d
        raise PlanError(self.path, "datasets", f"no dataset named {name!r}")

    def order(self) -> list[str]:
        return topo_order(self.path, self.stages)

    def dependants(self, stage_id: str) -> list[str]:
        return [s.id for s in self.stages if stage_id in s.after or stage_id in s.uses]


# --------------------------------------------------------------------------------------------
def load(path: Path | str, run_dir: Path | str | None = None) -> Plan:
    """Read, validate and expand a plan file. ``run_dir`` overrides ``[run] dir``."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(path, "", "plan file not found") from None
    except UnicodeDecodeError as exc:
        raise PlanError(path, "", f"not UTF-8 text: {exc}") from None
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise PlanError(path, "", f"not valid TOML: {exc or 'nested too deeply'}") from None
    except OSError as exc:
        raise PlanError(path, "", f"cannot read the plan: {exc.strerror or exc}") from None
    # A plan frozen into a run dir resolves relative paths against where the original plan lived.
    origin = path.parent / "plan-origin.json"
    base = None
    if origin.is_file():
        try:
            base = Path(json.loads(origin.read_text())["base"])
        except (ValueError, KeyError, TypeError, OSError):
            base = None
    return from_dict(raw, path, run_dir, base=base)


def from_dict(
    raw: dict[str, Any], path: Path, run_dir: Path | str | None = None, base: Path | None = None
) -> Plan:
    base = base or path.parent.absolute()
    _type(path, "", raw, dict, "a table at the top level")
    for key in raw:
        if key not in CORE_KEYS | SECTION_KEYS:
            raise PlanError(
                path,
                _key("", key),
                f"unknown top-level key (known: {', '.join(sorted(CORE_KEYS | SECTION_KEYS))})",
            )
    run = RunSection.parse(raw.get("run", {}), path)
    name = run.name if run.name is not None else path.stem
    if run_dir is None:
        d = _text(path, "run.dir", run.dir, "a string (the run directory)", empty=False)
        run_dir = Path(d).expanduser()
        if not run_dir.is_absolute():
            run_dir = base / run_dir
    executor = Executor.parse(raw.get("executor", {}), path)

    settings = PlanSettings.parse(raw, path)
    if "slurm" in raw and executor.kind != "slurm":
        raise PlanError(
            path, "slurm", f'a [slurm] table needs executor.kind = "slurm" (it is {executor.kind!r})'
        )
    cpu_slots, gpus = settings.resources.cpu_slots, list(settings.resources.gpus)
    datasets = datasets_from(path, raw.get("datasets", []), base)
    stages = stages_from(path, raw.get("stage", []), datasets, cpu_slots, tuple(gpus), executor.kind)
    plan = Plan(
        path=path,
        name=name,
        run_dir=Path(run_dir),
        executor=executor,
        cpu_slots=cpu_slots,
        gpus=tuple(gpus),
        datasets=datasets,
        stages=stages,
        settings=settings,
        raw=raw,
    )
    plan.order()  # raises on cycles
    return plan


def render_dag(plan: Plan) -> str:
    """A text rendering of the DAG for ``aerie plan check``: families, then each stage's edges."""
    lines = [
        f"plan {plan.name}  ({plan.path})",
        f"  executor: {plan.executor.kind}" + (f" {plan.executor.host}" if plan.executor.host else ""),
        f"  run dir:  {plan.run_dir}",
        f"  resources: {plan.cpu_slots} CPU slots, GPUs {list(plan.gpus) or 'none'}",
        f"  datasets: {len(plan.datasets)} ({sum(d.quota for d in plan.datasets):,} samples)",
        "",
    ]
    by_id = {s.id: s for s in plan.stages}
    level: dict[str, int] = {}
    for sid in plan.order():
        s = by_id[sid]
        level[sid] = 1 + max((level[d] for d in (*s.after, *s.uses)), default=-1)
    fam_rows: dict[str, list[StageSpec]] = {}
    for sid in sorted(plan.order(), key=lambda i: level[i]):
        fam_rows.setdefault(by_id[sid].family, []).append(by_id[sid])
    for fam, specs in fam_rows.items():
        first = specs[0]
        what = first.run or f"$ {first.command}"
        tags = []
        if first.service:
            tags.append("service")
        if first.gpus:
            tags.append(f"gpus {','.join(map(str, first.gpus))}")
        tags.append(f"cpu {first.cpu}")
        if first.nodes > 1:
            tags.append(f"nodes {first.nodes}")
        lines.append(
            f"[{level[first.id]}] {fam}  ({what}; {'; '.join(tags)})"
            + (f"  x{len(specs)}" if len(specs) > 1 else "")
        )
        for s in specs:
            deps = ", ".join(_compress(list(s.after))) or "-"
            uses = f"  uses {', '.join(s.uses)}" if s.uses else ""
            lines.append(f"      {s.id:<28} after {deps}{uses}")
    return "\n".join(lines)


def _compress(ids: list[str]) -> list[str]:
    """Show ``prep.a, prep.b, ... prep.j`` as ``prep.* (10)``."""
    fams: dict[str, list[str]] = {}
    for i in ids:
        fams.setdefault(i.split(".")[0] if "." in i else i, []).append(i)
    out = []
    for fam, members in fams.items():
        if len(members) > 2 and all("." in m for m in members):
            out.append(f"{fam}.* ({len(members)})")
        else:
            out.extend(members)
    return out
