"""The remote agent: ``python -m pipeline.run.hosts.remote_agent RUN``, the console's one channel into a remote run.

The SSH transport starts this once per connection on the executing host and speaks JSON lines
over its stdin/stdout, so a console poll costs one round trip on an open channel instead of a
login shell per command. It only reads files inside the run directory and runs
``pipeline.run.supervise.ctl``; it never signals anything itself. When the channel closes (the console quit,
the network dropped, sshd died) stdin reaches EOF and the agent exits; the supervisor and the
stages, which run in their own sessions, are not affected.

Requests (one JSON object per line, ``id`` echoed in the answer)::

    {"id": 1, "op": "hello"}              -> {"protocol", "pid", "root", "exists", "python", "pipeline"}
    {"id": 2, "op": "ping"}                                   -> {"t"}
    {"id": 3, "op": "read", "reqs": [["state.json", 0], ["stages/a/events.jsonl", 812]],
     "max_bytes": 1048576}                                    -> {"results": [[b64 data, size, ino], ...]}
    {"id": 4, "op": "ctl", "args": ["kill", "train"]}         -> {"rc", "stdout", "stderr"}
    {"id": 5, "op": "lines", "path": "stages/a/stage.log", "offset": 0}
                                    -> pipeline.run.rundir.logscan.count_file's answer (newlines per block)
    {"id": 6, "op": "find", "path": ..., "pattern": "ERROR", "start": 0, "end": null, "line0": 0,
     "backward": false, "limit": 1000}   -> pipeline.run.rundir.logscan.find_file's answer (matching lines)

Every answer carries ``"ok": true`` or ``"ok": false, "error": "..."``. ``size`` is -1 for a
missing file. ``read`` answers are bounded in total (:data:`READ_BUDGET`): a file whose share did
not fit comes back short, and the reader simply continues from its new offset next time (a file that
must be read whole, ``state.json``, in further requests: ``console.transport.read_whole``). The console
splits answers into lines itself, so an answer may be longer than the SSH channel's window.
``lines`` and ``find`` (the console's log viewer) scan bounded amounts per request, in a thread,
so a multi-GB log is indexed and searched on the host while reads keep being answered.
Only the standard library and ``pipeline`` are used: this runs on the container.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.run.hosts.procs import env_with_pipeline, package_root
from pipeline.run.rundir import logscan

# 2: ctl takes --via and --who (the audit log): a console sending them needs a host that knows them
PROTOCOL = 2
READ_BUDGET = 16 << 20  # bytes of file data in one read answer, all files together
CTL_TIMEOUT_S = 120.0


class AgentError(ValueError):
    """A request the agent refuses (bad path, unknown op)."""


def _safe_path(root: Path, rel: object) -> Path:
    """``root/rel``, refusing absolute paths and anything that leaves the run directory, also through a
    symlink (``stages/a/stage.log -> /etc/shadow``, or a symlinked directory on the way)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel:
        raise AgentError(f"bad run-relative path {rel!r}")
    parts = Path(rel).parts
    if ".." in parts:
        raise AgentError(f"path {rel!r} leaves the run directory")
    path = root / rel
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)  # resolves every symlink that exists; a missing tail stays as written
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise AgentError(f"path {rel!r} leaves the run directory (it resolves to {real})")
    return path


def read_many(root: Path, reqs: list[Any], max_bytes: int, budget: int = READ_BUDGET) -> list[list[Any]]:
    """For each ``[rel, offset]``: ``[base64 bytes from offset, file size, inode]`` (size -1: missing)."""
    out: list[list[Any]] = []
    left = budget
    for item in reqs:
        rel, offset = item[0], int(item[1])
        if offset < 0 or max_bytes < 0:
            raise AgentError(f"negative offset or size for {rel!r}")
        path = _safe_path(root, rel)
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                data = b""
                if st.st_size > offset and left > 0:
                    fh.seek(offset)
                    data = fh.read(min(max_bytes, st.st_size - offset, left))
                    left -= len(data)
                out.append([base64.b64encode(data).decode("ascii"), st.st_size, st.st_ino])
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            out.append(["", -1, 0])
    return out


def run_ctl(root: Path, args: list[str], timeout_s: float = CTL_TIMEOUT_S) -> dict[str, Any]:
    """``python -m pipeline.run.supervise.ctl ROOT *args`` with this interpreter and this ``pipeline``."""
    if not all(isinstance(a, str) for a in args):
        raise AgentError("ctl arguments must be strings")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "pipeline.run.supervise.ctl", str(root), *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            env=env_with_pipeline(),
            timeout=timeout_s,
            cwd="/",
        )
    except subprocess.TimeoutExpired:
        return {
            "rc": 4,
            "stdout": "",
            "stderr": f"error: pipeline.run.supervise.ctl {' '.join(args)} gave no answer in {timeout_s:g}s",
        }
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


class Agent:
    """Serves one channel: reads inline (fast), ctl actions in threads (they wait for the supervisor)."""

    def __init__(self, root: Path, out: BinaryIO) -> None:
        self.root = root
        self.out = out
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.out.write(line)
            self.out.flush()

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "hello":
            return {
                "protocol": PROTOCOL,
                "pid": os.getpid(),
                "root": str(self.root),
                "exists": (self.root / "plan.toml").is_file(),
                "python": sys.version.split()[0],
                "pipeline": str(Path(package_root()) / "pipeline"),
            }
        if op == "ping":
            return {"t": time.time()}
        if op == "read":
            reqs = req.get("reqs") or []
            if not isinstance(reqs, list) or not all(isinstance(r, list) and len(r) == 2 for r in reqs):
                raise AgentError("reqs must be a list of [path, offset] pairs")
            return {"results": read_many(self.root, reqs, int(req.get("max_bytes", 1 << 20)))}
        if op == "ctl":
            return run_ctl(self.root, list(req.get("args") or []), float(req.get("timeout", CTL_TIMEOUT_S)))
        if op == "lines":
            return logscan.count_file(
                _safe_path(self.root, req.get("path")),
                int(req.get("offset", 0)),
                int(req.get("max_bytes", logscan.COUNT_MAX_BYTES)),
                int(req.get("block", logscan.BLOCK)),
            )
        if op == "find":
            end = req.get("end")
            return logscan.find_file(
                _safe_path(self.root, req.get("path")),
                str(req.get("pattern", "")),
                int(req.get("start", 0)),
                None if end is None else int(end),
                int(req.get("line0", 0)),
                bool(req.get("backward")),
                int(req.get("limit", 1000)),
            )
        raise AgentError(f"unknown op {op!r}")

    def handle(self, req: dict[str, Any]) -> None:
        rid = req.get("id")
        try:
            reply = {"id": rid, "ok": True, **self.answer(req)}
        except (AgentError, ValueError, TypeError, IndexError, OSError) as exc:
            reply = {"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.send(reply)

    def serve(self, inp: BinaryIO) -> int:
        for raw in inp:
            if not raw.strip():
                continue
            try:
                req = json.loads(raw)
                if not isinstance(req, dict):
                    raise ValueError("a request is a JSON object")
            except ValueError as exc:
                self.send({"id": None, "ok": False, "error": f"bad request: {exc}"})
                continue
            if req.get("op") in ("ctl", "lines", "find"):
                # Not a daemon: an action already sent finishes and answers even if stdin closes.
                threading.Thread(target=self._handle_quietly, args=(req,)).start()
            else:
                self.handle(req)
        return 0

    def _handle_quietly(self, req: dict[str, Any]) -> None:
        # The channel may have gone away while a ctl action ran; its effect is in the run dir.
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.handle(req)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeline.run.hosts.remote_agent RUN", file=sys.stderr)
        return 2
    root = Path(argv[0]).expanduser().absolute()
    # Our protocol owns fd 1; anything else printing to stdout would corrupt it, so point
    # sys.stdout at stderr and keep a private handle on the real stdout.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    sys.stdout = sys.stderr
    agent = Agent(root, out)
    try:
        return agent.serve(sys.stdin.buffer)
    except (BrokenPipeError, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
