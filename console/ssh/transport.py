"""The SSH transport: the console's :class:`~console.transport.Transport` over one SSH connection.

Reads and control actions go through one long-lived channel running ``python -m
pipeline.run.hosts.remote_agent RUN`` on the host (JSON lines; see that module), so a poll costs one round
trip, not a login shell. Everything else the console does is unchanged: the model asks for byte
ranges from its own offsets, so after a reconnect it simply asks again from where it was — no
event is lost and none is shown twice.

While the connection is down, :meth:`SshTransport.read_many` raises :class:`NotConnected` at once
(the model keeps what it has and the header says ``disconnected — retrying (n)``), and
:meth:`SshTransport.ctl` answers exit code 255 without sending anything. A ``ctl`` whose channel
died mid-flight is never re-sent (a retry must not be applied twice): the answer says it is
unconfirmed and the board shows the real state once the connection is back.

:class:`RemoteLayout` is what bootstrap recorded in ``RUN/.aerie/layout.json`` — the remote
interpreter and where Aerie's ``pipeline`` lives there — so ``aerie attach`` needs only the host
and the run directory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import asyncssh

from console.ssh.connection import HostConnection, NotConnected, SshError, remote_python
from console.transport import ConnectionStatus, CtlResult, ReadResult

AGENT_PROTOCOL = 2  # must equal pipeline.run.hosts.remote_agent.PROTOCOL (checked at every agent start)
LAYOUT_FILE = ".aerie/layout.json"
EXIT_UNREACHABLE = 255  # like ssh(1): the command could not be delivered
CALL_TIMEOUT_S = 60.0
RTT_SMOOTHING = 0.3


@dataclass
class RemoteLayout:
    """Where a run lives on the host and how to run Aerie's ``pipeline`` there."""

    root: str  # absolute run directory on the host
    python: str  # the host's interpreter (absolute, as resolved at bootstrap)
    pythonpath: str | None = None  # the uploaded pipeline package's parent; None: the host's own
    plan: str = ""  # the uploaded plan the run was created from

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, raw: bytes | str, where: str) -> RemoteLayout:
        try:
            d = json.loads(raw)
            return cls(
                root=str(d["root"]),
                python=str(d["python"]),
                pythonpath=d.get("pythonpath"),
                plan=str(d.get("plan", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SshError(f"{where}: corrupt layout file: {exc}") from None


class _Agent:
    """One running remote agent: request ids -> futures, a reader task, stderr kept for diagnostics."""

    def __init__(self, proc: asyncssh.SSHClientProcess, release: Any, label: str) -> None:
        self.proc = proc
        self.release = release
        self.label = label
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.alive = True
        self.stderr_tail: list[str] = []
        loop = asyncio.get_running_loop()
        self.reader = loop.create_task(self._read())
        self.err_reader = loop.create_task(self._read_err())

    async def _read(self) -> None:
        # Answers are split into lines here, not by asyncssh's readline: that gives up on a line longer than
        # the channel's receive window (2 MiB), and a read answer may be up to READ_BUDGET (16 MiB) of data.
        buf = bytearray()
        scanned = 0  # bytes of buf already searched for a newline
        try:
            while True:
                data = await self.proc.stdout.read(1 << 20)
                if not data:
                    break
                buf += data
                while (nl := buf.find(b"\n", scanned)) >= 0:
                    line = bytes(buf[:nl])
                    del buf[: nl + 1]
                    scanned = 0
                    self._answer(line)
                scanned = len(buf)
        except (asyncssh.Error, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._closed()

    def _answer(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = json.loads(line)
        except ValueError:
            self.stderr_tail.append(line[:300].decode(errors="replace").rstrip())
            return
        fut = self.pending.pop(msg.get("id"), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _read_err(self) -> None:
        with contextlib.suppress(asyncssh.Error, OSError):
            while True:
                line = await self.proc.stderr.readline()
                if not line:
                    return
                self.stderr_tail = (self.stderr_tail + [line.decode(errors="replace").rstrip()])[-20:]

    def _closed(self) -> None:
        self.alive = False
        why = "; ".join(self.stderr_tail[-3:])
        err = NotConnected(f"{self.label}: the remote agent's channel closed" + (f" ({why})" if why else ""))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()
        self.release()

    async def call(self, op: str, timeout_s: float, **payload: Any) -> dict[str, Any]:
        if not self.alive:
            raise NotConnected(f"{self.label}: the remote agent's channel is closed")
        rid = next(self.ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            self.proc.stdin.write((json.dumps({"id": rid, "op": op, **payload}) + "\n").encode())
            await self.proc.stdin.drain()
        except (asyncssh.Error, OSError, BrokenPipeError) as exc:
            self.pending.pop(rid, None)
            raise NotConnected(f"{self.label}: connection lost ({exc or type(exc).__name__})") from None
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise NotConnected(
                f"{self.label}: no answer from the remote agent within {timeout_s:g}s"
            ) from None
        finally:
            self.pending.pop(rid, None)  # answered, timed out, or the caller was cancelled

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write_eof()
        with contextlib.suppress(Exception):
            self.proc.close()


class SshTransport:
    """The run directory is on ``conn``'s host at ``layout.root``."""

    def __init__(self, conn: HostConnection, layout: RemoteLayout, owns_connection: bool = True) -> None:
        self.conn = conn
        self.layout = layout
        self.run_root = layout.root
        self.owns_connection = owns_connection
        self._agent: _Agent | None = None
        self._starting: asyncio.Task | None = None
        self._ever_connected = conn.connected
        self.remote_pipeline = ""  # where the agent's pipeline package lives on the host (diagnostics)
        conn.on_reconnect(self._prestart)

    @property
    def status(self) -> ConnectionStatus:
        return self.conn.status

    # -------------------------------------------------------------------------------- agent
    async def _ensure_agent(self) -> _Agent:
        """The live agent, starting one if needed.

        The start runs as its own task that callers only wait on (shielded): the console's poll
        worker is cancelled and re-issued every tick, and a start cut off half-way would leak a
        channel (and a MaxSessions slot) each time.
        """
        if self._agent is not None and self._agent.alive:
            return self._agent
        if self._starting is None or self._starting.done():
            self._starting = asyncio.get_running_loop().create_task(self._start_agent())
            self._starting.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._starting)

    def _prestart(self) -> None:
        """On reconnect, start the new agent right away instead of at the console's next poll."""
        if self._ever_connected and (self._starting is None or self._starting.done()):
            self._starting = asyncio.get_running_loop().create_task(self._start_agent())
            self._starting.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _start_agent(self) -> _Agent:
        if not self._ever_connected:
            # First use (e.g. inside the console's own event loop): connect strictly.
            await self.conn.connect()
            self._ever_connected = True
        cmd = remote_python(
            self.layout.python,
            self.layout.pythonpath,
            "-m",
            "pipeline.run.hosts.remote_agent",
            self.layout.root,
        )
        proc, release = await self.conn.open_process(cmd)
        agent = _Agent(proc, release, self.conn.target.label)
        try:
            hello = await agent.call("hello", CALL_TIMEOUT_S)
            if hello.get("protocol") != AGENT_PROTOCOL:
                raise SshError(
                    f"{self.conn.target.label}: the remote pipeline speaks agent protocol "
                    f"{hello.get('protocol')}, this console {AGENT_PROTOCOL}: run `aerie preflight PLAN` "
                    "to upload the matching pipeline package"
                )
            if not hello.get("exists"):
                raise SshError(
                    f"{self.conn.target.label}: no Aerie run at {self.layout.root} (no plan.toml there)"
                )
        except BaseException:
            agent.close()
            raise
        self.remote_pipeline = str(hello.get("pipeline", ""))
        self._agent = agent
        return agent

    async def _call(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **payload: Any) -> dict[str, Any]:
        agent = await self._ensure_agent()
        t0 = time.perf_counter()
        rep = await agent.call(op, timeout_s, **payload)
        if op in ("ping", "read"):
            ms = (time.perf_counter() - t0) * 1000
            prev = self.status.rtt_ms
            self.status.rtt_ms = ms if prev is None else prev + RTT_SMOOTHING * (ms - prev)
        if not rep.get("ok"):
            raise SshError(f"{self.conn.target.label}: remote agent: {rep.get('error')}")
        return rep

    # ---------------------------------------------------------------------------- interface
    async def read_many(self, reqs: list[tuple[str, int]], max_bytes: int = 1 << 20) -> list[ReadResult]:
        rep = await self._call("read", reqs=[[rel, int(off)] for rel, off in reqs], max_bytes=max_bytes)
        return [ReadResult(base64.b64decode(b64), int(size), int(ino)) for b64, size, ino in rep["results"]]

    async def count_lines(
        self, rel: str, offset: int, max_bytes: int = 128 << 20, block: int = 64 << 10
    ) -> dict[str, Any]:
        """Newline counts per block, computed by the agent on the host (only the counts travel)."""
        return await self._scan(
            "lines", path=rel, offset=int(offset), max_bytes=int(max_bytes), block=int(block)
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
        """Regex matches by line, searched by the agent on the host (only line numbers/offsets travel)."""
        return await self._scan(
            "find",
            path=rel,
            pattern=pattern,
            start=int(start),
            end=end,
            line0=int(line0),
            backward=bool(backward),
            limit=int(limit),
        )

    async def _scan(self, op: str, **payload: Any) -> dict[str, Any]:
        try:
            rep = await self._call(op, **payload)
        except SshError as exc:
            if "unknown op" in str(exc):
                raise SshError(
                    f"{self.conn.target.label}: the remote pipeline predates the log viewer's "
                    f"'{op}' request: run `aerie preflight PLAN` to upload the current one"
                ) from None
            raise
        rep.pop("id", None)
        rep.pop("ok", None)
        return rep

    async def ctl(self, *args: str) -> CtlResult:
        what = " ".join(args)
        try:
            agent = await self._ensure_agent()
        except SshError as exc:
            return CtlResult(EXIT_UNREACHABLE, "", f"error: {exc}; `{what}` was not sent")
        try:
            rep = await agent.call("ctl", 180.0, args=list(args))
        except NotConnected as exc:
            return CtlResult(
                EXIT_UNREACHABLE,
                "",
                f"error: {exc}; `{what}` may or may not have been applied: "
                "the board shows the stage's real state once reconnected",
            )
        if not rep.get("ok"):
            return CtlResult(EXIT_UNREACHABLE, "", f"error: remote agent: {rep.get('error')}")
        return CtlResult(int(rep["rc"]), str(rep.get("stdout", "")), str(rep.get("stderr", "")))

    async def ping(self) -> float:
        """Round trip of a trivial request over the live channel, in seconds."""
        t0 = time.perf_counter()
        await self._call("ping")
        return time.perf_counter() - t0

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self.owns_connection:
            await self.conn.close()


# ------------------------------------------------------------------------------------ helpers
def sftp_path(path: str) -> str:
    """SFTP does not expand ``~``: a path under the home directory is given relative to it."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


class LayoutMissing(SshError):
    """The run dir has no ``layout.json``: a run started on the host itself (:mod:`console.ssh.adopt`)."""


async def load_layout(conn: HostConnection, remote_dir: str) -> RemoteLayout:
    """Read the layout bootstrap recorded in a remote run dir (``aerie attach``)."""
    where = f"{conn.target.label}:{remote_dir.rstrip('/')}/{LAYOUT_FILE}"
    async with conn.sftp() as sftp:
        try:
            async with sftp.open(sftp_path(f"{remote_dir.rstrip('/')}/{LAYOUT_FILE}"), "rb") as fh:
                raw = await fh.read()
        except (asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath, asyncssh.SFTPFailure):
            raise LayoutMissing(
                f"{where}: not found — no run bootstrapped by Aerie's ssh preflight there"
            ) from None
    return RemoteLayout.from_json(raw, where)


async def start_remote_run(conn: HostConnection, layout: RemoteLayout) -> str:
    """Create the run from the uploaded plan and start its supervisor detached on the host.

    The supervisor runs in its own session with stdin from /dev/null and output to its log, so it
    and the stages it launches keep running when this connection (or the console) goes away.
    Starting an existing run again only re-attaches (one supervisor per run dir, by flock).
    """
    cmd = remote_python(
        layout.python,
        layout.pythonpath,
        "-m",
        "pipeline.run.supervise.supervisor",
        "--create",
        layout.plan,
        layout.root,
        "--detach",
    )
    r = await conn.run(cmd, timeout_s=60.0)
    if r.returncode != 0:
        raise SshError(
            f"{conn.target.label}: starting the supervisor failed (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-800:]}"
        )
    return r.stdout.strip()
