"""The plan's ``[executor]`` and ``[[datasets]]``: their types and the checks that read them (see :mod:`.plan`).

Every error is a :class:`~pipeline.run.schema.PlanError` naming the file and the key. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.run.schema import PlanError, check_int, check_text, check_type
from pipeline.run.schema import key_name as _key

_type, _text, _int = check_type, check_text, check_int

DATASET_KINDS = ("target-native", "prompt-only")
EXECUTOR_KINDS = ("local", "ssh", "slurm")
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
class Executor:
    kind: str = "local"
    host: str | None = None
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    remote_dir: str | None = None
    python: str = "python3"
    options: dict[str, Any] = field(default_factory=dict)


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
_HOST_BAD = set(" \t'\"`$;&|<>(){}\\*?!#")


def check_name(file: Path, key: str, value: Any, what: str) -> str:
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


def executor_from(path: Path, ex: Any) -> Executor:
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


def datasets_from(path: Path, items: Any, base: Path) -> list[Dataset]:
    _type(path, "datasets", items, list, "an array of tables ([[datasets]])")
    out: list[Dataset] = []
    seen: set[str] = set()
    for i, d in enumerate(items):
        key = f"datasets[{i}]"
        _type(path, key, d, dict, "a table")
        for k in d:
            if k not in DATASET_KEYS:
                raise PlanError(path, _key(key, k), f"unknown key (known: {', '.join(sorted(DATASET_KEYS))})")
        name = check_name(path, f"{key}.name", d.get("name"), "dataset name")
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
        if "thinking" in options and not isinstance(options["thinking"], bool):
            # Whether the target answered (or answers, in regen) with its reasoning on; unset: the model's default.
            raise PlanError(
                path, f"{key}.options.thinking", f"expected true or false, got {options['thinking']!r}"
            )
        out.append(Dataset(name, source, kind, quota, p, d.get("split"), d.get("config"), dict(options)))
    return out
