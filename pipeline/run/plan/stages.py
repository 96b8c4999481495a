"""The plan's ``[[stage]]`` entries: :class:`StageSpec` (one expanded stage, as the supervisor runs it), the
built-in stage programs, and the expansion of the entries into the DAG (``for_each``, ``after``/``uses``
globs, Slurm replicas), with its order (see :mod:`.dag`). Standard library only.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from pipeline.run.plan.schema import (
    MAX_INT,
    REQUIRED,
    PlanError,
    Section,
    check_int,
    check_text,
    check_type,
    setting,
)
from pipeline.run.plan.schema import key_name as _key
from pipeline.run.plan.tables import Dataset, check_name

_type, _text, _int, _name = check_type, check_text, check_int, check_name


@dataclass(frozen=True)
class RetryPolicy(Section):
    """A stage's ``retry``: how often and how soon a failed attempt is tried again."""

    NAME: ClassVar[str] = "retry"

    max_attempts: int = setting(1, "attempts in all (1: no automatic retry)", lo=1, hi=1000)
    backoff_s: float = setting(30.0, "seconds before the next attempt", lo=0, hi=7 * 86400)


@dataclass(frozen=True)
class StageEntry(Section):
    """One ``[[stage]]`` entry as the plan writes it (before ``for_each`` and ``replicas`` expand it)."""

    NAME: ClassVar[str] = "stage"

    id: str = setting(
        REQUIRED,
        "the stage's id (its family, for an expanded entry)",
        check=lambda file, key, v: _name(Path(file), key, v, "stage id"),
    )
    run: str | None = setting(None, "a built-in stage's short name (prep, train, ...)")
    command: str | None = setting(None, "an operator shell command", multiline=True)
    for_each: str | None = setting(None, '"dataset": one stage per dataset')
    when: dict[str, Any] = setting({}, "with for_each: filter datasets on kind, name or source")
    args: tuple[str, ...] = setting((), "arguments; {dataset}, {kind} and {source} are substituted")
    after: tuple[str, ...] = setting((), "stages (ids or globs) it runs after")
    uses: tuple[str, ...] = setting((), "service stages that must be ready while it runs")
    service: bool = setting(False, "a long-running server: dependants start once it is ready")
    cpu: int = setting(1, "CPU slots it holds", lo=-MAX_INT)
    gpus: tuple[int, ...] | str | int = setting((), 'GPU ids, "all", or (Slurm) a count per node')
    output_bytes: int = setting(0, "bytes it is expected to write", lo=0, hi=1 << 62)
    retry: dict[str, Any] = setting({}, "max_attempts, backoff_s (see RetryPolicy)")
    env: dict[str, Any] = setting({}, "environment variables for its process")
    skip: bool = setting(False, "do not run it (counts as satisfied)")
    pause_grace_s: float = setting(10.0, "seconds a pause waits for the stage", lo=0, hi=86400)
    kill_grace_s: float = setting(10.0, "SIGTERM -> wait this long -> SIGKILL", lo=0, hi=86400)
    description: str = setting("", "what it does, for the console", multiline=True)
    label: str = setting("", "a short label")
    nodes: int = setting(1, "Slurm: the job's node count", lo=1, hi=100_000)
    slurm: dict[str, Any] = setting({}, "Slurm: this stage's [slurm] overrides")
    replicas: int = setting(1, "Slurm service: one server job per replica", lo=1, hi=1000)

    def check(self, file: Path | str, name: str) -> None:
        if (self.run is None) == (self.command is None):
            self.bad(
                file, name, "give exactly one of 'run' (a built-in stage: prep, train, ...) or 'command'"
            )
        if self.run is not None and self.run not in BUILTIN_STAGES:
            legacy = _legacy_run(self.run)
            hint = (
                f"; plans name built-in stages by short name: run = {legacy!r}"
                if legacy in BUILTIN_STAGES
                else ""
            )
            self.bad(
                file, f"{name}.run", f"unknown stage {self.run!r} (known: {', '.join(BUILTIN_STAGES)}){hint}"
            )
        if self.command is not None:
            _text(file, f"{name}.command", self.command, "a shell command", multiline=True, empty=False)
        if self.for_each is not None and self.for_each != "dataset":
            self.bad(file, f"{name}.for_each", f"only 'dataset' is supported, got {self.for_each!r}")
        for wk, wv in self.when.items():
            if wk not in ("kind", "name", "source"):
                self.bad(file, _key(f"{name}.when", wk), "can filter on kind, name or source")
            _type(file, f"{name}.when.{wk}", wv, str, "a string")
        if self.when and self.for_each is None:
            self.bad(file, f"{name}.when", "'when' needs for_each = \"dataset\"")
        for ek, ev in self.env.items():
            if (
                not ek
                or not (ek[0].isascii() and (ek[0].isalpha() or ek[0] == "_"))
                or not all(c.isascii() and (c.isalnum() or c == "_") for c in ek)
            ):
                self.bad(file, f"{name}.env", f"{ek!r} is not an environment variable name")
            _text(file, f"{name}.env.{ek}", ev, multiline=True)
        RetryPolicy.parse(self.retry, file, f"{name}.retry")
        if self.replicas > 1 and self.for_each:
            self.bad(file, f"{name}.replicas", "replicas cannot be combined with for_each")


@dataclass(frozen=True)
class StageSpec:
    """One expanded stage, as the supervisor runs it."""

    id: str
    family: str  # the [[stage]] entry's id: groups the 10 preps as one block on the board
    run: str | None = None  # built-in stage's short name, e.g. "prep" (see BUILTIN_STAGES)
    command: str | None = None  # operator shell command
    dataset: str | None = None
    args: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    service: bool = False
    cpu: int = 1
    gpus: tuple[int, ...] = ()
    output_bytes: int = 0
    retry: RetryPolicy = RetryPolicy()
    env: dict[str, str] = field(default_factory=dict)
    skip: bool = False
    pause_grace_s: float = 10.0
    kill_grace_s: float = 10.0
    description: str = ""
    nodes: int = 1  # Slurm executor: the job's node count (``--nodes``)
    slurm: dict[str, Any] = field(default_factory=dict)  # Slurm executor: this stage's [slurm] overrides

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "family": self.family,
            "run": self.run,
            "command": self.command,
            "dataset": self.dataset,
            "args": list(self.args),
            "after": list(self.after),
            "uses": list(self.uses),
            "service": self.service,
            "cpu": self.cpu,
            "gpus": list(self.gpus),
            "output_bytes": self.output_bytes,
            "retry": {"max_attempts": self.retry.max_attempts, "backoff_s": self.retry.backoff_s},
            "env": dict(self.env),
            "skip": self.skip,
            "pause_grace_s": self.pause_grace_s,
            "kill_grace_s": self.kill_grace_s,
            "description": self.description,
            "nodes": self.nodes,
            "slurm": dict(self.slurm),
        }

    def launch_fields(self) -> dict[str, Any]:
        """What the launcher starts, written into ``launch.json``: no launcher imports the plan (docs/design.md)."""
        module = stage_module(self.run) if self.run else None
        fields = {"id": self.id, "module": module, "args": list(self.args), "command": self.command}
        return fields | {"after": list(self.after), "cpu": self.cpu, "gpus": list(self.gpus), "env": self.env}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageSpec:
        r = d.get("retry") or {}
        return cls(
            id=d["id"],
            family=d.get("family", d["id"]),
            run=_legacy_run(d.get("run")),
            command=d.get("command"),
            dataset=d.get("dataset"),
            args=tuple(d.get("args", ())),
            after=tuple(d.get("after", ())),
            uses=tuple(d.get("uses", ())),
            service=bool(d.get("service")),
            cpu=int(d.get("cpu", 1)),
            gpus=tuple(d.get("gpus", ())),
            output_bytes=int(d.get("output_bytes", 0)),
            retry=RetryPolicy(int(r.get("max_attempts", 1)), float(r.get("backoff_s", 30.0))),
            env=dict(d.get("env", {})),
            skip=bool(d.get("skip")),
            pause_grace_s=float(d.get("pause_grace_s", 10.0)),
            kill_grace_s=float(d.get("kill_grace_s", 10.0)),
            description=d.get("description", ""),
            nodes=int(d.get("nodes", 1)),
            slurm=dict(d.get("slurm") or {}),
        )


# The built-in stage programs, by the short name a plan gives in ``run``. Each module has a
# ``__main__`` entry (``python -m MODULE --plan PLAN --stage ID``).
BUILTIN_STAGES: dict[str, str] = {
    "prep": "pipeline.stages.prep",
    "regen": "pipeline.stages.regen",
    "serve": "pipeline.stages.serve",
    "extract": "pipeline.stages.extract",
    "vocab": "pipeline.stages.vocab",
    "train": "pipeline.stages.train",
    "bench": "pipeline.stages.bench",
    "telemetry": "pipeline.stages.telemetry",
}


def _legacy_run(run: str | None) -> str | None:
    """A run dir frozen by an older Aerie names stages by module (``pipeline.prep``): re-attach to it."""
    if run and run.startswith("pipeline.") and run.rsplit(".", 1)[-1] in BUILTIN_STAGES:
        return run.rsplit(".", 1)[-1]
    return run


def stage_module(name: str) -> str:
    """The module a built-in stage's short name runs (``"train"`` -> ``pipeline.stages.train``)."""
    try:
        return BUILTIN_STAGES[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r} (known: {', '.join(BUILTIN_STAGES)})") from None


def _subst(value: str, ds: Dataset | None) -> str:
    if ds is None:
        return value
    return value.replace("{dataset}", ds.name).replace("{kind}", ds.kind).replace("{source}", ds.source)


@dataclass(frozen=True)
class _Context:
    """What a ``[[stage]]`` entry is checked against: the plan's datasets, resources and executor."""

    path: Path
    datasets: list[Dataset]
    cpu_slots: int
    gpus: tuple[int, ...]
    executor_kind: str

    @property
    def slurm(self) -> bool:
        return self.executor_kind == "slurm"


def stages_from(
    path: Path,
    items: Any,
    datasets: list[Dataset],
    cpu_slots: int,
    gpus: tuple[int, ...],
    executor_kind: str = "local",
) -> list[StageSpec]:
    """The ``[[stage]]`` entries expanded into stages (one per dataset, one per replica), with their
    ``after`` and ``uses`` resolved to stage ids."""
    ctx = _Context(path, datasets, cpu_slots, gpus, executor_kind)
    _type(path, "stage", items, list, "an array of tables ([[stage]])")
    expanded: list[tuple[str, StageSpec, list[str], list[str]]] = []  # key, spec, raw after, raw uses
    families: set[str] = set()
    groups: dict[str, list[str]] = {}  # a replicated service's id -> its replicas' stage ids
    for i, s in enumerate(items):
        key = f"stage[{i}]"
        entry = StageEntry.parse(s, path, key)
        if entry.id in families:
            raise PlanError(path, f"{key}.id", f"duplicate stage id {entry.id!r}")
        families.add(entry.id)
        base = _base_spec(ctx, key, entry)
        if entry.replicas > 1:
            # One stage (one Slurm job) per replica: serve.r1 ... serve.rN; `uses = ["serve"]` means them all.
            groups[entry.id] = [f"{entry.id}.r{k}" for k in range(1, entry.replicas + 1)]
        for ds, stage_id in _targets(ctx, key, entry, groups):
            spec = _expand(base, entry, ds, stage_id)
            expanded.append(
                (key, spec, [_subst(a, ds) for a in entry.after], [_subst(u, ds) for u in entry.uses])
            )
    return _link(path, expanded, groups)


def _base_spec(ctx: _Context, key: str, e: StageEntry) -> StageSpec:
    """The entry's resources, checked against the plan's, as a spec every expanded stage starts from."""
    path, slurm = ctx.path, ctx.slurm
    if slurm:  # Slurm's nodes hold the CPUs (cpus-per-task), not this host's slots
        _int(path, f"{key}.cpu", e.cpu, "an integer", lo=0, hi=100_000)
    elif not 0 <= e.cpu <= ctx.cpu_slots:
        raise PlanError(
            path, f"{key}.cpu", f"{e.cpu} slots requested but resources.cpu_slots is {ctx.cpu_slots}"
        )
    gpus = _stage_gpus(ctx, key, e.gpus)
    if e.nodes > 1 and not slurm:
        raise PlanError(
            path,
            f"{key}.nodes",
            f'nodes = {e.nodes} needs executor.kind = "slurm" '
            f"(a {ctx.executor_kind} executor runs every stage on one host)",
        )
    from pipeline.run.plan.sections import SlurmSection  # here: a launcher reads a StageSpec without them

    SlurmSection.parse(e.slurm, path, f"{key}.slurm")  # checked as [slurm] is; the keys it sets override
    if e.replicas > 1 and not (slurm and e.service):
        raise PlanError(
            path,
            f"{key}.replicas",
            "replicas > 1 needs a service stage (service = true) under "
            'executor.kind = "slurm" (one server job per replica)',
        )
    if e.slurm and not slurm:
        raise PlanError(
            path,
            f"{key}.slurm",
            f'Slurm overrides need executor.kind = "slurm" (it is {ctx.executor_kind!r})',
        )
    return StageSpec(
        id=e.id,
        family=e.id,
        run=e.run,
        service=e.service,
        cpu=e.cpu,
        gpus=gpus,
        output_bytes=e.output_bytes,
        retry=RetryPolicy.parse(e.retry, path, f"{key}.retry"),
        skip=e.skip,
        pause_grace_s=e.pause_grace_s,
        kill_grace_s=e.kill_grace_s,
        description=e.description,
        nodes=e.nodes,
        slurm=dict(e.slurm),
    )


def _stage_gpus(ctx: _Context, key: str, sg: tuple[int, ...] | str | int) -> tuple[int, ...]:
    """A stage's ``gpus``: ids from resources.gpus, "all" of them, or (Slurm) a count per node."""
    path, slurm = ctx.path, ctx.slurm
    if sg == "all":
        return ctx.gpus
    if slurm and isinstance(sg, int):
        # Under Slurm a stage asks for a number of GPUs per node; Slurm picks which.
        return tuple(range(_int(path, f"{key}.gpus", sg, "a number of GPUs per node", hi=4096)))
    if not isinstance(sg, tuple):
        want = 'a list of GPU ids or "all"' + (" or a count" if slurm else "")
        raise PlanError(path, f"{key}.gpus", f"expected {want}, got {type(sg).__name__} {sg!r}")
    for j, g in enumerate(sg):
        if g not in ctx.gpus and not slurm:
            raise PlanError(path, f"{key}.gpus[{j}]", f"GPU {g} is not in resources.gpus {list(ctx.gpus)}")
    return tuple(sg)


def _targets(
    ctx: _Context, key: str, e: StageEntry, groups: dict[str, list[str]]
) -> list[tuple[Dataset | None, str]]:
    """The (dataset, stage id) pairs an entry expands into: one per replica, per matching dataset, or itself."""
    if e.replicas > 1:
        return [(None, r) for r in groups[e.id]]
    if not e.for_each:
        return [(None, e.id)]
    if not ctx.datasets:
        raise PlanError(ctx.path, f"{key}.for_each", 'for_each = "dataset" but the plan has no [[datasets]]')
    matching = [d for d in ctx.datasets if all(getattr(d, wk) == wv for wk, wv in e.when.items())]
    return [(ds, f"{e.id}.{ds.name}") for ds in matching]


def _expand(base: StageSpec, e: StageEntry, ds: Dataset | None, stage_id: str) -> StageSpec:
    """The stage ``stage_id`` of entry ``e``, its words substituted for dataset ``ds``."""
    stage_args = [_subst(a, ds) for a in e.args]
    if e.run is not None and ds is not None and "--dataset" not in stage_args:
        stage_args = ["--dataset", ds.name, *stage_args]
    return replace(
        base,
        id=stage_id,
        command=_subst(e.command, ds) if e.command else None,
        dataset=ds.name if ds else None,
        args=tuple(stage_args),
        env={k: _subst(v, ds) for k, v in e.env.items()},
    )


def _link(
    path: Path, expanded: list[tuple[str, StageSpec, list[str], list[str]]], groups: dict[str, list[str]]
) -> list[StageSpec]:
    """Each stage with its ``after`` and ``uses`` patterns resolved to stage ids; ``uses`` only services."""
    ids = [spec.id for _, spec, _, _ in expanded]
    services = {spec.id for _, spec, _, _ in expanded if spec.service}
    out: list[StageSpec] = []
    for key, spec, after, uses in expanded:
        dep_ids = _resolve(path, f"{key}.after", after, ids, spec.id, groups)
        use_ids = _resolve(path, f"{key}.uses", uses, ids, spec.id, groups)
        for u in use_ids:
            if u not in services:
                raise PlanError(path, f"{key}.uses", f"{u!r} is not a service stage (service = true)")
        out.append(replace(spec, after=tuple(dep_ids), uses=tuple(use_ids)))
    return out


def _resolve(
    path: Path,
    key: str,
    patterns: list[str],
    ids: list[str],
    self_id: str,
    groups: dict[str, list[str]] | None = None,
) -> list[str]:
    out: list[str] = []
    groups = groups or {}
    for pat in patterns:
        if any(c in pat for c in "*?["):
            hits = [i for i in ids if fnmatch.fnmatchcase(i, pat) and i != self_id]
            # A glob may legitimately match nothing (no prompt-only datasets): that is not an error.
        elif pat in groups:
            hits = list(groups[pat])
        else:
            if pat not in ids:
                raise PlanError(path, key, f"unknown stage {pat!r} (stages: {', '.join(ids)})")
            hits = [pat]
        for h in hits:
            if h == self_id:
                raise PlanError(path, key, f"stage {self_id!r} depends on itself")
            if h not in out:
                out.append(h)
    return out


def topo_order(path: Path, stages: list[StageSpec]) -> list[str]:
    """Plan order made dependency-consistent; raises :class:`PlanError` naming a cycle."""
    # Iterative depth-first search: a plan with thousands of chained stages must not hit Python's
    # recursion limit (that would be a traceback, not a plan error).
    by_id = {s.id: s for s in stages}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    order: list[str] = []
    for s in stages:
        if state.get(s.id):
            continue
        state[s.id] = 1
        path_ids = [s.id]
        todo = [iter((*s.after, *s.uses))]
        while todo:
            dep = next(todo[-1], None)
            if dep is None:
                todo.pop()
                done = path_ids.pop()
                state[done] = 2
                order.append(done)
                continue
            st = state.get(dep, 0)
            if st == 1:
                cycle = path_ids[path_ids.index(dep) :] + [dep]
                raise PlanError(path, "stage", "dependency cycle: " + " -> ".join(cycle))
            if st == 0:
                state[dep] = 1
                path_ids.append(dep)
                todo.append(iter((*by_id[dep].after, *by_id[dep].uses)))
    return order
