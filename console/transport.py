"""Transports: how the console reaches the run directory and the host's control entry point.

The console's model never opens files or processes itself; it asks a transport for
(1) byte ranges of run-dir files from an offset (event streams, logs, state.json), and for the
    log viewer newline counts per block and regex matches by line (``pipeline.run.rundir.logscan``), so a
    multi-GB log is indexed and searched where it lives; :func:`read_whole` builds a whole file of any
    size (``state.json`` of a 10,000-stage plan) from bounded reads, the same on every transport,
(2) control commands (``python -m pipeline.run.supervise.ctl RUN ACTION STAGE``) executed on the host,
(3) creating a run and starting its supervisor there.

:class:`LocalTransport` does this on this machine (file reads in a worker thread, subprocesses
through asyncio). The SSH transport does the same through one asyncssh connection. Every method
is a coroutine: nothing here blocks the UI loop.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.run.rundir import logscan


@dataclass
class ConnectionStatus:
    """What the header shows: where the run executes and whether we can reach it."""

    host: str = "local"
    state: str = (
        "connected"  # connected | connecting | disconnected | refused (host key/credentials: no retry)
    )
    retries: int = 0
    rtt_ms: float | None = None
    detail: str = ""

    def label(self) -> str:
        if self.state == "refused":
            return f"{self.host}: refused — not retrying (see the status line)"
        if self.state == "disconnected":
            return f"{self.host}: disconnected — retrying ({self.retries})"
        if self.state == "connecting":
            return f"{self.host}: connecting…"
        rtt = f" · rtt {self.rtt_ms:.0f} ms" if self.rtt_ms is not None else ""
        return f"{self.host}{rtt}"


@dataclass
class ReadResult:
    """Bytes read from ``offset``; ``size`` is the file's size (-1 when it does not exist)."""

    data: bytes
    size: int
    ino: int = 0


@dataclass
class CtlResult:
    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def message(self) -> str:
        return (self.stdout.strip() or self.stderr.strip()).replace("error: ", "", 1)


class Transport(Protocol):
    run_root: str

    @property
    def status(self) -> ConnectionStatus:
        """The link's state (a local run directory is always connected)."""
        ...

    async def read_many(self, reqs: list[tuple[str, int]], max_bytes: int = 1 << 20) -> list[ReadResult]:
        """For each (run-relative path, offset): the bytes appended since ``offset``."""
        ...

    async def ctl(self, *args: str) -> CtlResult:
        """Run ``python -m pipeline.run.supervise.ctl RUN *args`` on the executing host."""
        ...

    async def count_lines(
        self, rel: str, offset: int, max_bytes: int = logscan.COUNT_MAX_BYTES, block: int = logscan.BLOCK
    ) -> dict[str, Any]:
        """Newlines per block of a run-dir file from ``offset`` (see ``pipeline.run.rundir.logscan.count_blocks``)."""
        ...

    async def find_lines(
        self,
        rel: str,
        pattern: str,
        start: int,
        end: int | None,
        line0: int,
        backward: bool = False,
        limit: int = 1000,
    ) -> dict[str, Any]:
        """Lines of a run-dir file matching a regex (see ``pipeline.run.rundir.logscan.find_lines``)."""
        ...

    async def close(self) -> None: ...


WHOLE_CHUNK = 8 << 20  # bytes per read while :func:`read_whole` completes a big file
WHOLE_TRIES = 3  # a file replaced while it was being read is read again, this many times in all


async def read_whole(transport: Transport, rel: str, first: ReadResult | None = None) -> ReadResult | None:
    """The whole of the run-dir file ``rel``, however big, read :data:`WHOLE_CHUNK` bytes at a time
    through ``transport.read_many`` (so local and SSH alike; the remote agent bounds each answer).

    ``first`` is a read at offset 0 already made (the console's batched poll): when it holds the whole
    file it is the answer, else the rest is read from where it stopped. The file must stay the same
    file (inode and size) between reads — ``state.json`` is replaced atomically, so a rewrite in between
    starts over. ``None`` when it kept being replaced (:data:`WHOLE_TRIES`): the caller keeps what it had."""
    for _ in range(WHOLE_TRIES):
        res = (
            first if first is not None else (await transport.read_many([(rel, 0)], max_bytes=WHOLE_CHUNK))[0]
        )
        first = None
        if res.size < 0 or len(res.data) >= res.size:
            return res
        parts, got = [res.data], len(res.data)
        while got < res.size:
            nxt = (await transport.read_many([(rel, got)], max_bytes=WHOLE_CHUNK))[0]
            if nxt.ino != res.ino or nxt.size != res.size or not nxt.data:
                break  # replaced meanwhile: read the new one from its start
            parts.append(nxt.data)
            got += len(nxt.data)
        if got >= res.size:
            return ReadResult(b"".join(parts)[: res.size], res.size, res.ino)
    return None


def _read_one(root: Path, rel: str, offset: int, max_bytes: int) -> ReadResult:
    path = root / rel
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size <= offset:
                return ReadResult(b"", st.st_size, st.st_ino)
            fh.seek(offset)
            return ReadResult(fh.read(min(max_bytes, st.st_size - offset)), st.st_size, st.st_ino)
    except FileNotFoundError:
        return ReadResult(b"", -1)


@dataclass
class LocalTransport:
    """The run directory is on this machine."""

    run_root: str
    python: str = sys.executable
    status: ConnectionStatus = field(default_factory=ConnectionStatus)

    async def read_many(self, reqs: list[tuple[str, int]], max_bytes: int = 1 << 20) -> list[ReadResult]:
        root = Path(self.run_root)
        return await asyncio.to_thread(lambda: [_read_one(root, rel, off, max_bytes) for rel, off in reqs])

    async def ctl(self, *args: str) -> CtlResult:
        proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "pipeline.run.supervise.ctl",
            self.run_root,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=child_env(),
        )
        out, err = await proc.communicate()
        return CtlResult(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))

    async def count_lines(
        self, rel: str, offset: int, max_bytes: int = logscan.COUNT_MAX_BYTES, block: int = logscan.BLOCK
    ) -> dict[str, Any]:
        return await asyncio.to_thread(
            logscan.count_file, Path(self.run_root) / rel, offset, max_bytes, block
        )

    async def find_lines(
        self,
        rel: str,
        pattern: str,
        start: int,
        end: int | None,
        line0: int,
        backward: bool = False,
        limit: int = 1000,
    ) -> dict[str, Any]:
        return await asyncio.to_thread(
            logscan.find_file, Path(self.run_root) / rel, pattern, start, end, line0, backward, limit
        )

    async def close(self) -> None:
        return None


def child_env() -> dict[str, str]:
    """The environment for a pipeline program this console starts: this ``pipeline`` first on the path."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_local_run(
    plan_path: Path, run_dir: Path | None, python: str = sys.executable
) -> tuple[int, str, str]:
    """Create the run dir and start its supervisor detached (used by ``aerie run`` before the UI)."""
    import subprocess

    cmd = [python, "-m", "pipeline.run.supervise.supervisor", "--create", str(plan_path), "--detach"]
    if run_dir is not None:
        cmd.insert(3, str(run_dir))
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout.strip(), p.stderr.strip()
