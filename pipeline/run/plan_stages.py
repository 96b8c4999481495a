"""The plan's ``[[stage]]`` entries: :class:`StageSpec` (one expanded stage, as the supervisor runs it), the
built-in stage programs, and the expansion of the entries into the DAG (``for_each``, ``after``/``uses``
globs, Slurm replicas), with its order (see :mod:`.plan`). Standard library only.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.run.plan_sections import SlurmSection
from pipeline.run.plan_tables import Dataset, check_name
from pipeline.run.schema import MAX_INT, PlanError, check_bool, check_int, check_num, check_text, check_type
from pipeline.run.schema import key_name as _key
from pipeline.run.schema import str_list as _str_list

_type, _text, _int, _num, _bool, _name = check_type, check_text, check_int, check_num, check_bool, check_name

STAGE_KEYS = {
    "id",
    "run",
    "command",
    "for_each",
    "when",
    "args",
    "after",
    "uses",
    "service",
    "cpu",
    "gpus",
    "output_bytes",
    "retry",
    "env",
    "skip",
    "pause_grace_s",
    "kill_grace_s",
    "description",
    "label",
    "nodes",
    "slurm",
    "replicas",
}


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 1  # 1 = no automatic retry
    backoff_s: float = 30.0


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


def _slurm(path: Path, key: str, table: Any) -> dict[str, Any]:
    """A stage's ``slurm = {...}``: checked as ``[slurm]`` is; only the keys it sets are kept (they override)."""
    SlurmSection.parse(table, path, key)
    return dict(table)


def _subst(value: str, ds: Dataset | None) -> str:
    if ds is None:
        return value
    return value.replace("{dataset}", ds.name).replace("{kind}", ds.kind).replace("{source}", ds.source)


def stages_from(
    path: Path,
    items: Any,
    datasets: list[Dataset],
    cpu_slots: int,
    gpus: tuple[int, ...],
    executor_kind: str = "local",
) -> list[StageSpec]:
    slurm = executor_kind == "slurm"
    _type(path, "stage", items, list, "an array of tables ([[stage]])")
    entries: list[tuple[str, dict, Dataset | None]] = []
    expanded: list[StageSpec] = []
    raw_deps: list[tuple[str, list[str], list[str]]] = []
    families: set[str] = set()
    groups: dict[str, list[str]] = {}  # a replicated service's id -> its replicas' stage ids
    for i, s in enumerate(items):
        key = f"stage[{i}]"
        _type(path, key, s, dict, "a table")
        for k in s:
            if k not in STAGE_KEYS:
                raise PlanError(path, _key(key, k), f"unknown key (known: {', '.join(sorted(STAGE_KEYS))})")
        sid = _name(path, f"{key}.id", s.get("id"), "stage id")
        if sid in families:
            raise PlanError(path, f"{key}.id", f"duplicate stage id {sid!r}")
        families.add(sid)
        run, command = s.get("run"), s.get("command")
        if (run is None) == (command is None):
            raise PlanError(
                path, key, "give exactly one of 'run' (a built-in stage: prep, train, ...) or 'command'"
            )
        if run is not None:
            _type(path, f"{key}.run", run, str, "a string")
            if run not in BUILTIN_STAGES:
                hint = (
                    f"; plans name built-in stages by short name: run = {_legacy_run(run)!r}"
                    if _legacy_run(run) in BUILTIN_STAGES
                    else ""
                )
                raise PlanError(
                    path, f"{key}.run", f"unknown stage {run!r} (known: {', '.join(BUILTIN_STAGES)}){hint}"
                )
        else:
            _text(path, f"{key}.command", command, "a shell command", multiline=True, empty=False)
        fe = s.get("for_each")
        if fe is not None and fe != "dataset":
            raise PlanError(path, f"{key}.for_each", f"only 'dataset' is supported, got {fe!r}")
        when = _type(path, f"{key}.when", s.get("when", {}), dict, "a table")
        for wk, wv in when.items():
            if wk not in ("kind", "name", "source"):
                raise PlanError(path, _key(f"{key}.when", wk), "can filter on kind, name or source")
            _type(path, f"{key}.when.{wk}", wv, str, "a string")
        if when and fe is None:
            raise PlanError(path, f"{key}.when", "'when' needs for_each = \"dataset\"")
        args = _str_list(path, f"{key}.args", s.get("args", []))
        after = _str_list(path, f"{key}.after", s.get("after", []))
        uses = _str_list(path, f"{key}.uses", s.get("uses", []))
        cpu = _int(path, f"{key}.cpu", s.get("cpu", 1), "an integer", lo=-MAX_INT)
        if slurm:  # Slurm's nodes hold the CPUs (cpus-per-task), not this host's slots
            _int(path, f"{key}.cpu", cpu, "an integer", lo=0, hi=100_000)
        elif not 0 <= cpu <= cpu_slots:
            raise PlanError(
                path, f"{key}.cpu", f"{cpu} slots requested but resources.cpu_slots is {cpu_slots}"
            )
        sg = s.get("gpus", [])
        if sg == "all":
            sg = list(gpus)
        if slurm and isinstance(sg, int) and not isinstance(sg, bool):
            # Under Slurm a stage asks for a number of GPUs per node; Slurm picks which.
            sg = list(range(_int(path, f"{key}.gpus", sg, "a number of GPUs per node", hi=4096)))
        _type(path, f"{key}.gpus", sg, list, 'a list of GPU ids or "all"' + (" or a count" if slurm else ""))
        for j, g in enumerate(sg):
            _int(path, f"{key}.gpus[{j}]", g, "an integer", lo=-MAX_INT)
            if g not in gpus and not slurm:
                raise PlanError(path, f"{key}.gpus[{j}]", f"GPU {g} is not in resources.gpus {list(gpus)}")
        nodes = _int(path, f"{key}.nodes", s.get("nodes", 1), "a number of nodes", lo=1, hi=100_000)
        if nodes > 1 and not slurm:
            raise PlanError(
                path,
                f"{key}.nodes",
                f'nodes = {nodes} needs executor.kind = "slurm" '
                f"(a {executor_kind} executor runs every stage on one host)",
            )
        stage_slurm = _slurm(path, f"{key}.slurm", s.get("slurm", {}))
        replicas = _int(
            path, f"{key}.replicas", s.get("replicas", 1), "a number of server jobs", lo=1, hi=1000
        )
        if replicas > 1 and not (slurm and s.get("service") is True):
            raise PlanError(
                path,
                f"{key}.replicas",
                "replicas > 1 needs a service stage (service = true) under "
                'executor.kind = "slurm" (one server job per replica)',
            )
        if replicas > 1 and fe:
            raise PlanError(path, f"{key}.replicas", "replicas cannot be combined with for_each")
        if stage_slurm and not slurm:
            raise PlanError(
                path,
                f"{key}.slurm",
                f'Slurm overrides need executor.kind = "slurm" (it is {executor_kind!r})',
            )
        ob = _int(
            path, f"{key}.output_bytes", s.get("output_bytes", 0), "an integer number of bytes", hi=1 << 62
        )
        retry = _type(path, f"{key}.retry", s.get("retry", {}), dict, "a table")
        for rk in retry:
            if rk not in ("max_attempts", "backoff_s"):
                raise PlanError(path, _key(f"{key}.retry", rk), "known keys: max_attempts, backoff_s")
        ma = _int(
            path, f"{key}.retry.max_attempts", retry.get("max_attempts", 1), "an integer", lo=1, hi=1000
        )
        bo = _num(path, f"{key}.retry.backoff_s", retry.get("backoff_s", 30.0), "a number", hi=7 * 86400)
        env = _type(path, f"{key}.env", s.get("env", {}), dict, "a table of strings")
        for ek, ev in env.items():
            if (
                not ek
                or not (ek[0].isascii() and (ek[0].isalpha() or ek[0] == "_"))
                or not all(c.isascii() and (c.isalnum() or c == "_") for c in ek)
            ):
                raise PlanError(path, f"{key}.env", f"{ek!r} is not an environment variable name")
            _text(path, f"{key}.env.{ek}", ev, multiline=True)
        for gk in ("pause_grace_s", "kill_grace_s"):
            if gk in s:
                _num(path, f"{key}.{gk}", s[gk], "a number of seconds", hi=86400)
        for bk in ("service", "skip"):
            if bk in s:
                _bool(path, f"{key}.{bk}", s[bk])
        if "description" in s:
            _text(path, f"{key}.description", s["description"], multiline=True)
        if "label" in s:
            _text(path, f"{key}.label", s["label"])
        targets = (
            [d for d in datasets if all(getattr(d, wk) == wv for wk, wv in when.items())] if fe else [None]
        )
        if fe and not datasets:
            raise PlanError(path, f"{key}.for_each", 'for_each = "dataset" but the plan has no [[datasets]]')
        if replicas > 1:
            # One stage (one Slurm job) per replica: serve.r1 ... serve.rN; `uses = ["serve"]` means them all.
            groups[sid] = [f"{sid}.r{k}" for k in range(1, replicas + 1)]
        for ds, stage_id in (
            [(None, r) for r in groups[sid]]
            if replicas > 1
            else [(ds, f"{sid}.{ds.name}" if ds else sid) for ds in targets]
        ):
            stage_args = [_subst(a, ds) for a in args]
            if run is not None and ds is not None and "--dataset" not in stage_args:
                stage_args = ["--dataset", ds.name, *stage_args]
            spec = StageSpec(
                id=stage_id,
                family=sid,
                run=run,
                command=_subst(command, ds) if command else None,
                dataset=ds.name if ds else None,
                args=tuple(stage_args),
                service=bool(s.get("service", False)),
                cpu=cpu,
                gpus=tuple(sg),
                output_bytes=ob,
                retry=RetryPolicy(ma, float(bo)),
                env={k: _subst(v, ds) for k, v in env.items()},
                skip=bool(s.get("skip", False)),
                pause_grace_s=float(s.get("pause_grace_s", 10.0)),
                kill_grace_s=float(s.get("kill_grace_s", 10.0)),
                description=str(s.get("description", "")),
                nodes=nodes,
                slurm=stage_slurm,
            )
            expanded.append(spec)
            entries.append((key, s, ds))
            raw_deps.append((key, [_subst(a, ds) for a in after], [_subst(u, ds) for u in uses]))
    ids = [s.id for s in expanded]
    services = {s.id for s in expanded if s.service}
    out: list[StageSpec] = []
    for spec, (key, after, uses) in zip(expanded, raw_deps, strict=True):
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
