"""The plan: a TOML file describing one run, loaded, validated and expanded into a stage DAG.

A plan names where the run executes, its run directory, the target model, the datasets and the
stages. A ``[[stage]]`` entry is either a built-in stage named by its short name (``run = "prep"``;
:data:`BUILTIN_STAGES` maps it to its ``pipeline.stages`` module) or an operator shell command (``command = "..."``); ``for_each = "dataset"`` expands one entry into
one stage per dataset (``prep.ultrachat`` ...), optionally filtered with ``when = {kind = ...}``.
Dependencies (``after``) may use ``{dataset}`` and globs (``"prep.*"``). ``uses`` names service
stages (an inference server) that must be *ready* while the stage runs; a stage that is ``after``
a service waits until the service has been stopped.

Every error names the plan file and the key (``stage[3].after``), so a typo never costs an hour.
This module needs only the standard library: it runs on the container and in the console.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.run.plan_sections import SECTIONS, PlanSettings, ResourcesSection, SlurmSection, TargetSection
from pipeline.run.schema import MAX_INT, PlanError, check_bool, check_int, check_num, check_text, check_type
from pipeline.run.schema import key_name as _key
from pipeline.run.schema import str_list as _str_list

DATASET_KINDS = ("target-native", "prompt-only")
EXECUTOR_KINDS = ("local", "ssh", "slurm")
CORE_KEYS = {"run", "executor", "datasets", "stage"}
# Every other top-level table is a typed settings section (pipeline/run/plan_sections.py).
SECTION_KEYS = set(SECTIONS)
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
DATASET_KEYS = {"name", "source", "kind", "quota", "path", "split", "config", "options"}


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str
    kind: str
    quota: int
    path: str | None = None
    split: str | None = None
    config: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class Executor:
    kind: str = "local"
    host: str | None = None
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    remote_dir: str | None = None
    python: str = "python3"
    options: dict[str, Any] = field(default_factory=dict)


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
_type, _text, _int, _num, _bool = check_type, check_text, check_int, check_num, check_bool
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
_HOST_BAD = set(" \t'\"`$;&|<>(){}\\*?!#")


def _name(file: Path, key: str, value: Any, what: str) -> str:
    """A stage id or dataset name: it becomes a directory name and a word in commands, so no path or
    shell characters at all (``../``, quotes, ``;``, ``$()``, spaces and non-ASCII are refused)."""
    _type(file, key, value, str, "a string")
    if not value or not set(value) <= _NAME_CHARS or len(value) > 100 or not value[0].isalnum():
        # and it starts with a letter or digit: "-rf" would read as an option wherever it is an argv word
        raise PlanError(
            file,
            key,
            f"{value!r}: a {what} uses only lowercase letters, digits, '-' and '_', "
            "starts with a letter or digit (at most 100)",
        )
    return value


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
    run = _type(path, "run", raw.get("run", {}), dict, "a table")
    for k in run:
        if k not in ("name", "dir"):
            raise PlanError(path, _key("run", k), "unknown key (known: dir, name)")
    name = _text(path, "run.name", run.get("name", path.stem))
    if run_dir is None:
        d = _text(path, "run.dir", run.get("dir"), "a string (the run directory)", empty=False)
        run_dir = Path(d).expanduser()
        if not run_dir.is_absolute():
            run_dir = base / run_dir
    executor = _executor(path, raw.get("executor", {}))

    settings = PlanSettings.parse(raw, path)
    if "slurm" in raw and executor.kind != "slurm":
        raise PlanError(
            path, "slurm", f'a [slurm] table needs executor.kind = "slurm" (it is {executor.kind!r})'
        )
    cpu_slots, gpus = settings.resources.cpu_slots, list(settings.resources.gpus)
    datasets = _datasets(path, raw.get("datasets", []), base)
    stages = _stages(path, raw.get("stage", []), datasets, cpu_slots, tuple(gpus), executor.kind)
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


def _executor(path: Path, ex: Any) -> Executor:
    _type(path, "executor", ex, dict, "a table")
    kind = ex.get("kind", "local")
    if kind not in EXECUTOR_KINDS:
        raise PlanError(path, "executor.kind", f"must be one of {', '.join(EXECUTOR_KINDS)}, got {kind!r}")
    known = {"kind", "host", "user", "port", "identity", "remote_dir", "python", "options"}
    for k in ex:
        if k not in known:
            raise PlanError(path, _key("executor", k), f"unknown key (known: {', '.join(sorted(known))})")
    if kind == "ssh" and not ex.get("host"):
        raise PlanError(
            path, "executor.host", "an ssh executor needs a host (an alias from ~/.ssh/config works)"
        )
    if kind == "ssh" and not ex.get("remote_dir"):
        raise PlanError(path, "executor.remote_dir", "an ssh executor needs the remote run directory")
    if kind == "slurm" and ex.get("host") and not ex.get("remote_dir"):
        raise PlanError(
            path,
            "executor.remote_dir",
            "a slurm executor reached over ssh (executor.host) needs the "
            "run directory on the cluster's shared filesystem",
        )
    for k in ("host", "user"):
        # A host or user is one word for ssh: never an option ("-oProxyCommand=...") nor shell text.
        v = ex.get(k)
        if v is not None:
            _text(path, f"executor.{k}", v, empty=False)
            if v.startswith("-") or any(c in _HOST_BAD for c in v):
                raise PlanError(
                    path,
                    f"executor.{k}",
                    f"{v!r}: not a valid {k} (no spaces, quotes, shell characters or leading '-')",
                )
    port = ex.get("port")
    if port is not None:
        _int(path, "executor.port", port, "an integer", lo=1, hi=65535)
    for k in ("identity", "remote_dir", "python"):
        # Paths on the host: kept verbatim and always passed quoted (shlex) or as one argv word.
        if ex.get(k) is not None:
            _text(path, f"executor.{k}", ex[k], "a path", empty=False)
    options = _type(path, "executor.options", ex.get("options", {}), dict, "a table")
    return Executor(
        kind=kind,
        host=ex.get("host"),
        user=ex.get("user"),
        port=port,
        identity=ex.get("identity"),
        remote_dir=ex.get("remote_dir"),
        python=ex.get("python", "python3"),
        options=dict(options),
    )


def _slurm(path: Path, key: str, table: Any) -> dict[str, Any]:
    """A stage's ``slurm = {...}``: checked as ``[slurm]`` is; only the keys it sets are kept (they override)."""
    SlurmSection.parse(table, path, key)
    return dict(table)


def _datasets(path: Path, items: Any, base: Path) -> list[Dataset]:
    _type(path, "datasets", items, list, "an array of tables ([[datasets]])")
    out: list[Dataset] = []
    seen: set[str] = set()
    for i, d in enumerate(items):
        key = f"datasets[{i}]"
        _type(path, key, d, dict, "a table")
        for k in d:
            if k not in DATASET_KEYS:
                raise PlanError(path, _key(key, k), f"unknown key (known: {', '.join(sorted(DATASET_KEYS))})")
        name = _name(path, f"{key}.name", d.get("name"), "dataset name")
        if name in seen:
            raise PlanError(path, f"{key}.name", f"duplicate dataset name {name!r}")
        seen.add(name)
        source = _text(path, f"{key}.source", d.get("source"), empty=False)
        kind = d.get("kind")
        if kind not in DATASET_KINDS:
            raise PlanError(path, f"{key}.kind", f"must be one of {', '.join(DATASET_KINDS)}, got {kind!r}")
        quota = _int(path, f"{key}.quota", d.get("quota"), "an integer number of samples", lo=1, hi=10**12)
        p = d.get("path")
        if p is not None:
            # Spaces, quotes, ';', '$()' and non-ASCII are fine in a path: it is only ever opened, never
            # given to a shell. Control characters are not.
            _text(path, f"{key}.path", p, "a path", empty=False)
            if not Path(p).expanduser().is_absolute():
                p = str(base / p)
        for k in ("split", "config"):
            if d.get(k) is not None:
                _text(path, f"{key}.{k}", d[k])
        options = _type(path, f"{key}.options", d.get("options", {}), dict, "a table")
        out.append(Dataset(name, source, kind, quota, p, d.get("split"), d.get("config"), dict(options)))
    return out


def _subst(value: str, ds: Dataset | None) -> str:
    if ds is None:
        return value
    return value.replace("{dataset}", ds.name).replace("{kind}", ds.kind).replace("{source}", ds.source)


def _stages(
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
