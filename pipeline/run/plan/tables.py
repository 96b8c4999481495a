"""The plan's ``[run]``, ``[executor]`` and ``[[datasets]]`` tables, typed (see :mod:`.dag`).

Each is a :class:`~pipeline.run.plan.schema.Section` like the settings tables (:mod:`.sections`): an
unknown key, a wrong type or a value out of range is refused when the plan loads, and so is an unknown
key in a dataset's ``options`` (:class:`DatasetOptions`). Every error is a :class:`~pipeline.run.plan.schema.PlanError` naming the file and the key. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from pipeline.run.plan.schema import REQUIRED, PlanError, Section, check_text, check_type, setting

_type, _text = check_type, check_text

DATASET_KINDS = ("target-native", "prompt-only")
EXECUTOR_KINDS = ("local", "ssh", "slurm")


@dataclass(frozen=True)
class RunSection(Section):
    """``[run]``: the run's name and directory."""

    NAME: ClassVar[str] = "run"

    name: str | None = setting(None, "the run's name (unset: the plan file's stem)")
    dir: str | None = setting(None, "the run directory (relative: to the plan file); required unless given")


@dataclass(frozen=True)
class DatasetOptions(Section):
    """A dataset's ``options``: where its rows come from and how they read (see :mod:`pipeline.data.sources`)."""

    NAME: ClassVar[str] = "options"

    hub: str | None = setting(None, "the hub dataset id (unset: the source's own)")
    data_files: str | tuple[str, ...] | dict[str, Any] | None = setting(
        None, "the hub dataset's data files (unset: the source's own)"
    )
    revision: str | None = setting(None, "the hub dataset's revision")
    field: str | None = setting(None, "the column holding the turns (messages, sharegpt, tool sources)")
    prompt_field: str | None = setting(None, "the prompt column (pair and reasoning sources)")
    response_field: str | None = setting(None, "the response column (pair and reasoning sources)")
    reasoning_field: str | None = setting(None, "the reasoning column (reasoning-trace sources)")
    thinking: bool | None = setting(
        None,
        "whether the target answered (regen: answers) with its reasoning on (unset: the model's default)",
    )
    reject_threshold: float | None = setting(
        None, "this dataset's [prep] reject_threshold (malformed rows above it fail prep)", lo=0, hi=1
    )

    def given(self) -> dict[str, Any]:
        """The options the plan set, as the sources read them (``opts.get(key, default)``)."""
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in self.to_dict().items() if v is not None
        }


@dataclass(frozen=True)
class Dataset(Section):
    """One ``[[datasets]]`` entry."""

    NAME: ClassVar[str] = "datasets"

    name: str = setting(
        REQUIRED,
        "the dataset's name (stage ids and directories use it)",
        check=lambda file, key, v: check_name(Path(file), key, v, "dataset name"),
    )
    source: str = setting(REQUIRED, "the source it reads (a pipeline.data.sources key or hub id)")
    kind: str = setting(REQUIRED, "target-native or prompt-only", choices=DATASET_KINDS)
    quota: int = setting(REQUIRED, "samples to take", lo=1, hi=10**12)
    path: str | None = setting(None, "a local file or directory (relative: to the plan file)")
    split: str | None = setting(None, "the hub split")
    config: str | None = setting(None, "the hub config")
    options: dict[str, Any] = setting({}, "how the source reads (see DatasetOptions)")

    def check(self, file: Path | str, name: str) -> None:
        _text(file, f"{name}.source", self.source, empty=False)
        if self.path is not None:
            # Spaces, quotes, ';', '$()' and non-ASCII are fine in a path: it is only ever opened, never
            # given to a shell. Control characters are not.
            _text(file, f"{name}.path", self.path, "a path", empty=False)


PIPELINE_MODES = ("auto", "upload", "installed")


@dataclass(frozen=True)
class SshOptions(Section):
    """``[executor] options`` of an executor reached over ssh (``ssh``, and ``slurm`` through its login node):
    the console's connection settings, typed here so ``aerie plan check`` refuses a misspelt one."""

    NAME: ClassVar[str] = "executor.options"

    known_hosts: str | None = setting(None, "a known_hosts file (unset: ssh's own)")
    ssh_config: str | None = setting(None, "an ssh client config (unset: ~/.ssh/config)")
    max_sessions: int = setting(10, "channels at once on the connection (OpenSSH's MaxSessions)", lo=1)
    keepalive_s: float = setting(5.0, "seconds between keepalives", positive=True)
    keepalive_count: int = setting(3, "unanswered keepalives before the link is down", lo=1)
    connect_timeout_s: float = setting(15.0, "seconds a connection may take", positive=True)
    pipeline: str = setting(
        "auto", "the host's pipeline: auto, upload (this checkout's) or installed", choices=PIPELINE_MODES
    )


@dataclass(frozen=True)
class NoOptions(Section):
    """``[executor] options`` of a kind that reads none (``local``)."""

    NAME: ClassVar[str] = "executor.options"


OPTIONS_BY_KIND: dict[str, type[Section]] = {"local": NoOptions, "ssh": SshOptions, "slurm": SshOptions}


@dataclass(frozen=True)
class Executor(Section):
    """``[executor]``: where the run executes (``options``: the console's ssh settings, see console/ssh)."""

    NAME: ClassVar[str] = "executor"

    kind: str = setting("local", "local, ssh or slurm", choices=EXECUTOR_KINDS)
    host: str | None = setting(None, "the ssh host (an alias from ~/.ssh/config works)")
    user: str | None = setting(None, "the ssh user")
    port: int | None = setting(None, "the ssh port", lo=1, hi=65535)
    identity: str | None = setting(None, "the ssh key file")
    remote_dir: str | None = setting(None, "the run directory on the host")
    python: str = setting("python3", "the host's Python")
    options: dict[str, Any] = setting({}, "the kind's options: ssh and slurm, SshOptions; local, none")

    def check(self, file: Path | str, name: str) -> None:
        self.check_options(file, name)
        if self.kind == "ssh" and not self.host:
            self.bad(file, f"{name}.host", "an ssh executor needs a host (an alias from ~/.ssh/config works)")
        if self.kind == "ssh" and not self.remote_dir:
            self.bad(file, f"{name}.remote_dir", "an ssh executor needs the remote run directory")
        if self.kind == "slurm" and self.host and not self.remote_dir:
            self.bad(
                file,
                f"{name}.remote_dir",
                "a slurm executor reached over ssh (executor.host) needs the "
                "run directory on the cluster's shared filesystem",
            )
        for k in ("host", "user"):
            # A host or user is one word for ssh: never an option ("-oProxyCommand=...") nor shell text.
            v = getattr(self, k)
            if v is not None:
                _text(file, f"{name}.{k}", v, empty=False)
                if v.startswith("-") or any(c in _HOST_BAD for c in v):
                    self.bad(
                        file,
                        f"{name}.{k}",
                        f"{v!r}: not a valid {k} (no spaces, quotes, shell characters or leading '-')",
                    )
        for k in ("identity", "remote_dir", "python"):
            # Paths on the host: kept verbatim and always passed quoted (shlex) or as one argv word.
            if getattr(self, k) is not None:
                _text(file, f"{name}.{k}", getattr(self, k), "a path", empty=False)

    def check_options(self, file: Path | str, name: str) -> None:
        """``options`` typed by the kind (:data:`OPTIONS_BY_KIND`): a key the kind does not read is refused."""
        typed = OPTIONS_BY_KIND[self.kind]
        if not fields(typed) and self.options:
            key = sorted(self.options)[0]
            self.bad(
                file,
                f"{name}.options.{key}",
                f"a {self.kind} executor reads no options (the ssh settings are for kind ssh or slurm)",
            )
        typed.parse(self.options, file, f"{name}.options")

    def ssh_options(self) -> SshOptions:
        """The typed ssh settings (defaults filled in) of an executor reached over ssh."""
        return SshOptions.parse(self.options, "plan", "executor.options")


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


def datasets_from(path: Path, items: Any, base: Path) -> list[Dataset]:
    """The ``[[datasets]]`` entries, each typed (:class:`Dataset`); relative paths resolved against ``base``."""
    _type(path, "datasets", items, list, "an array of tables ([[datasets]])")
    out: list[Dataset] = []
    seen: set[str] = set()
    for i, d in enumerate(items):
        key = f"datasets[{i}]"
        ds = Dataset.parse(d, path, key)
        if ds.name in seen:
            raise PlanError(path, f"{key}.name", f"duplicate dataset name {ds.name!r}")
        seen.add(ds.name)
        if ds.path is not None and not Path(ds.path).expanduser().is_absolute():
            ds = replace(ds, path=str(base / ds.path))
        out.append(replace(ds, options=DatasetOptions.parse(ds.options, path, f"{key}.options").given()))
    return out
