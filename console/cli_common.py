"""What the ``aerie`` commands share: naming a run (a local directory or a remote one), opening it, and
running ``pipeline.run.supervise.ctl`` on it locally; the error line every command prints; ``AERIE_HOME``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import stat
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


def stdout_closed() -> bool:
    """Is stdout a pipe whose reader has gone (``aerie status RUN | head -1``)?"""
    try:
        if not stat.S_ISFIFO(os.fstat(1).st_mode):
            return False
        poller = select.poll()
        poller.register(1, 0)
        return any(ev & select.POLLERR for _fd, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def closed_pipe_exit() -> int:
    """Exit quietly as a command killed by SIGPIPE does (128 + 13), with no traceback and no error line:
    stdout goes to /dev/null so the interpreter's last flush cannot complain either."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 128 + signal.SIGPIPE
