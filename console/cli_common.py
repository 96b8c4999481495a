"""What the ``aerie`` commands share: naming a run (a local directory or a remote one), opening it, and
running ``pipeline.run.supervise.ctl`` on it locally; the error line every command prints; ``AERIE_HOME``."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from console.transport import LocalTransport
from pipeline.run.rundir.layout import RunDir

EXIT_USAGE = 2


def aerie_home() -> Path:
    """Where Aerie keeps its own files on this machine (demo runs, ``aerie watch``'s delivered ids)."""
    return Path(os.environ.get("AERIE_HOME", Path.home() / ".local" / "share" / "aerie")).expanduser()


def err(text: str) -> None:
    print(f"aerie: error: {text}", file=sys.stderr)


def remote(arg: str) -> bool:
    """A run named by ``ssh://host/path`` or by its plan file (console.ssh handles those)."""
    return arg.startswith("ssh://") or (arg.endswith(".toml") and Path(arg).is_file())


def open_run(path: str) -> RunDir | None:
    run = RunDir(path)
    if not run.exists():
        err(f"{run.root}: no such run (expected plan.toml and stages/ there)")
        return None
    return run


def run_ctl(run: RunDir, *argv: str) -> tuple[int, str, str]:
    res = asyncio.run(LocalTransport(str(run.root)).ctl(*argv))
    return res.returncode, res.stdout, res.stderr
