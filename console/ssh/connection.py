"""One asyncssh connection per host, shared by every channel, kept alive and re-established on loss.

:class:`HostConnection` owns the single SSH connection to the executing host. Commands, the
remote agent's channel and SFTP are all channels on it, and a counter keeps the number of open
sessions within the server's ``MaxSessions`` (OpenSSH's default is 10). Keepalives detect a dead
peer; when the connection is lost, a background task reconnects with exponential backoff while
:attr:`HostConnection.status` says ``disconnected — retrying (n)`` — callers get
:class:`NotConnected` meanwhile, never a hang.

Host keys are always checked against known_hosts (the plan's ``[executor] options.known_hosts``,
else ssh's own: ``UserKnownHostsFile`` from the ssh config, else ``~/.ssh/known_hosts``). An
unknown or changed key is refused with :class:`HostKeyError`, whose message says how to check the
fingerprint and accept it; a config that disables checking (``UserKnownHostsFile none``) is
refused too. ``~/.ssh/config`` aliases work because asyncssh reads the config (HostName, Port,
User, IdentityFile, ProxyJump ...); ``user``/``port``/``identity`` from the plan override it.

Over 450 lines because :class:`HostConnection` is one job — the lifetime of one SSH connection (connect,
host keys, session accounting, keepalive, reconnect) — whose states are easiest to check read together.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncssh

from console import executors
from console.transport import ConnectionStatus
from pipeline.run.plan.dag import Executor, PlanError

DEFAULT_MAX_SESSIONS = 10  # OpenSSH's MaxSessions default
CHANNEL_OPEN_TRIES = 6  # ~0.6 s of retries when the server refuses a channel (see _open_retrying)


class SshError(RuntimeError):
    """Something about the SSH connection, phrased for the operator."""


class HostKeyError(SshError):
    """The server's host key is not the one known_hosts has (or known_hosts has none): refused."""

    def __init__(self, message: str, changed: bool = False, fingerprint: str = "") -> None:
        super().__init__(message)
        self.changed = changed
        self.fingerprint = fingerprint


class AuthError(SshError):
    """The server refused our credentials."""


class NotConnected(SshError, ConnectionError):
    """The connection is down right now (a reconnect is under way)."""


@dataclass(frozen=True)
class SshTarget:
    """Where to connect: the plan's ``[executor]`` (or an ``ssh://`` URL) plus connection settings."""

    host: str
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    known_hosts: str | None = None  # a known_hosts file; None: ssh's own (config, ~/.ssh/known_hosts)
    ssh_config: str | None = None  # an ssh client config; None: ~/.ssh/config
    max_sessions: int = DEFAULT_MAX_SESSIONS
    keepalive_s: float = 5.0
    keepalive_count: int = 3
    connect_timeout_s: float = 15.0

    @classmethod
    def from_executor(cls, ex: Executor, file: str | Path = "plan") -> SshTarget:
        """The target a plan's ``[executor]`` names; bad ``options`` are refused naming the key."""
        host = executors.ssh_host(ex)  # slurm too: its login node is reached over ssh
        if host is None:
            raise SshError(f"{file}: executor: {ex.kind!r} is not an ssh executor with a host")
        try:
            o = ex.ssh_options()  # typed when the plan loaded (aerie plan check); a plan built in code too
        except PlanError as exc:
            raise SshError(str(exc).replace("plan: ", f"{file}: ", 1)) from None
        return cls(
            host=host,
            user=ex.user,
            port=ex.port,
            identity=str(Path(ex.identity).expanduser()) if ex.identity else None,
            known_hosts=str(Path(o.known_hosts).expanduser()) if o.known_hosts else None,
            ssh_config=str(Path(o.ssh_config).expanduser()) if o.ssh_config else None,
            max_sessions=o.max_sessions,
            keepalive_s=o.keepalive_s,
            keepalive_count=o.keepalive_count,
            connect_timeout_s=o.connect_timeout_s,
        )

    @property
    def label(self) -> str:
        """How the header names the host: as the operator wrote it."""
        s = f"{self.user}@{self.host}" if self.user else self.host
        return f"{s}:{self.port}" if self.port else s

    def ssh_command(self) -> str:
        """The equivalent OpenSSH command line (for messages telling the operator what to run)."""
        parts = ["ssh"]
        if self.port:
            parts += ["-p", str(self.port)]
        if self.identity:
            parts += ["-i", self.identity]
        if self.ssh_config:
            parts += ["-F", self.ssh_config]
        if self.known_hosts:
            parts += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        parts.append(f"{self.user}@{self.host}" if self.user else self.host)
        return shlex.join(parts)


def parse_ssh_url(url: str) -> tuple[SshTarget, str]:
    """``ssh://[user@]host[:port]/abs/run/dir`` (or ``.../~/runs/x``) -> target and remote run dir."""
    parts = urlsplit(url)
    if parts.scheme != "ssh" or not parts.hostname:
        raise SshError(f"{url!r}: expected ssh://[user@]host[:port]/path/to/run")
    path = unquote(parts.path)
    if path.startswith("/~"):
        path = path[1:]
    if not path or path == "/":
        raise SshError(f"{url!r}: no remote run directory after the host")
    return SshTarget(host=parts.hostname, user=parts.username, port=parts.port), path


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str


class _Client(asyncssh.SSHClient):
    """Remembers the host key the server offered, so a refusal can show its fingerprint."""

    def __init__(self, owner: HostConnection) -> None:
        self._owner = owner

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self._owner._offered = (host, addr, port, key)
        return False  # known_hosts already said no; never trust on first use silently


class HostConnection:
    """The one connection to a host. ``await connect()`` first; then run/open_process/sftp."""

    def __init__(self, target: SshTarget, backoff_s: tuple[float, float] = (0.5, 15.0)) -> None:
        self.target = target
        self.status = ConnectionStatus(host=target.label, state="connecting")
        self.backoff_s = backoff_s
        self.drops = 0  # connections lost so far
        self.fatal: SshError | None = None  # why reconnecting stopped (host key, credentials)
        self._conn: asyncssh.SSHClientConnection | None = None
        self._slots = asyncio.Semaphore(max(1, target.max_sessions))
        self._in_use = 0
        self._watch: asyncio.Task | None = None
        self._closed = False
        self._offered: tuple[str, str, int, asyncssh.SSHKey] | None = None
        self._on_reconnect: list[Callable[[], Any]] = []

    # -------------------------------------------------------------------------------- connect
    def _connect_kwargs(self) -> dict[str, Any]:
        t = self.target
        kw: dict[str, Any] = {
            "known_hosts": t.known_hosts if t.known_hosts else (),
            "config": [t.ssh_config] if t.ssh_config else (),
            "keepalive_interval": t.keepalive_s,
            "keepalive_count_max": t.keepalive_count,
            "connect_timeout": t.connect_timeout_s,
            "login_timeout": t.connect_timeout_s,
        }
        if t.user:
            kw["username"] = t.user
        if t.port:
            kw["port"] = t.port
        if t.identity:
            kw["client_keys"] = [t.identity]
        return kw

    def _known_hosts_files(self) -> list[str]:
        """The known_hosts files this connection checks against; refuses a config that disables checking."""
        kw = self._connect_kwargs()
        try:
            opts = asyncssh.SSHClientConnectionOptions(host=self.target.host, **kw)
        except (OSError, ValueError, asyncssh.Error) as exc:
            raise SshError(f"{self.target.label}: bad ssh settings: {exc}") from None
        kh = opts.known_hosts
        if kh is None:
            raise HostKeyError(
                f"{self.target.label}: your ssh config disables host key checking (UserKnownHostsFile none); "
                "Aerie always checks host keys. Remove that setting for this host or set "
                "[executor] options.known_hosts to a known_hosts file."
            )
        files = [kh] if isinstance(kh, str) else [str(f) for f in kh] if isinstance(kh, list | tuple) else []
        if not files:
            files = [str(Path("~/.ssh/known_hosts").expanduser())]
        return [str(Path(f).expanduser()) for f in files]

    async def _open(self) -> None:
        files = self._known_hosts_files()
        kw = self._connect_kwargs()
        if self.target.known_hosts and not Path(self.target.known_hosts).is_file():
            raise HostKeyError(
                f"{self.target.label}: known_hosts file {self.target.known_hosts} does not exist; "
                f"create it by connecting once with: {self.target.ssh_command()}"
            )
        self._offered = None
        try:
            conn = await asyncssh.connect(self.target.host, client_factory=lambda: _Client(self), **kw)
        except asyncssh.HostKeyNotVerifiable as exc:
            raise self._host_key_error(files, str(exc)) from None
        except asyncssh.PermissionDenied:
            who = self.target.user or "the configured user"
            how = (
                f"identity {self.target.identity}"
                if self.target.identity
                else "your ssh agent / default keys"
            )
            raise AuthError(
                f"{self.target.label}: permission denied for {who} with {how}; check [executor] user/"
                f"identity or your ssh config (try: {self.target.ssh_command()})"
            ) from None
        except (TimeoutError, asyncssh.Error, OSError) as exc:
            raise SshError(f"{self.target.label}: cannot connect: {exc or type(exc).__name__}") from None
        self._conn = conn
        self.status.state, self.status.retries, self.status.detail = "connected", 0, ""
        for fn in list(self._on_reconnect):
            fn()

    def _host_key_error(self, files: list[str], raw: str) -> HostKeyError:
        if self._offered is None:
            return HostKeyError(f"{self.target.label}: host key refused: {raw}")
        host, addr, port, key = self._offered
        spec = host if port in (22, None) else f"[{host}]:{port}"
        fp = key.get_fingerprint("sha256")
        alg = key.get_algorithm()
        existing = [f for f in files if Path(f).is_file()]
        trusted: list[asyncssh.SSHKey] = []
        with contextlib.suppress(Exception):
            if existing:
                trusted = list(
                    asyncssh.match_known_hosts(existing, host, addr, port if port != 22 else None)[0]
                )
        kh = existing[0] if existing else files[0]
        port_opt = f"-p {port} " if port not in (22, None) else ""
        accept = (
            f"accept it with `ssh-keyscan {port_opt}{shlex.quote(host)} >> {shlex.quote(kh)}` "
            f"(or connect once with `{self.target.ssh_command()}` and answer yes)"
        )
        check = (
            "check it on the host itself (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`, or from the "
            "container's console)"
        )
        if trusted:
            old = ", ".join(sorted({k.get_fingerprint("sha256") for k in trusted}))
            return HostKeyError(
                f"{self.target.label}: REFUSED: the host key of {spec} has CHANGED. known_hosts ({kh}) has {old}; "
                f"the server now offers {alg} {fp}. This is what a man-in-the-middle looks like, or the container was "
                f"rebuilt with a new key. Before trusting it, {check}. If it matches, remove the old entry with "
                f"`ssh-keygen -R {shlex.quote(spec)} -f {shlex.quote(kh)}` and then {accept}.",
                changed=True,
                fingerprint=fp,
            )
        return HostKeyError(
            f"{self.target.label}: REFUSED: {spec} is not in known_hosts ({', '.join(files)}); the server offers "
            f"{alg} {fp}. Aerie never trusts a host key on first use: {check}, then {accept}.",
            changed=False,
            fingerprint=fp,
        )

    async def connect(self) -> HostConnection:
        """Connect (once, strictly: errors are raised), then keep the connection up in the background."""
        if self._conn is not None:
            return self
        self.status.state = "connecting"
        if self.fatal:
            raise self.fatal
        try:
            await self._open()
        except SshError as exc:
            self.status.state, self.status.detail = "disconnected", str(exc)
            self.status.retries += 1
            if isinstance(exc, HostKeyError | AuthError):
                self.fatal = exc  # never hammer a host whose key or credentials were refused
                self.status.state = "refused"
            raise
        self._watch = asyncio.get_running_loop().create_task(self._keep_up())
        return self

    async def _keep_up(self) -> None:
        while not self._closed:
            conn = self._conn
            assert conn is not None
            await conn.wait_closed()
            if self._closed:
                return
            self._conn = None
            self.drops += 1
            self.status.state, self.status.rtt_ms, self.status.retries = "disconnected", None, 0
            self.status.detail = "connection lost"
            delay = self.backoff_s[0]
            while not self._closed:
                self.status.retries += 1
                try:
                    await self._open()
                    break
                except (HostKeyError, AuthError) as exc:
                    # Retrying cannot fix a changed key or refused credentials: stop and say so.
                    self.fatal = exc
                    self.status.state, self.status.detail = "refused", str(exc)
                    return
                except SshError as exc:
                    self.status.detail = str(exc)
                await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))
                delay = min(delay * 2, self.backoff_s[1])

    def on_reconnect(self, fn: Callable[[], Any]) -> None:
        self._on_reconnect.append(fn)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def _require(self) -> asyncssh.SSHClientConnection:
        if self._conn is not None and self._conn.is_closed():  # lost a moment ago; _keep_up will notice
            raise NotConnected(f"{self.target.label}: connection lost — reconnecting")
        if self._conn is None:
            if self.fatal:
                raise NotConnected(str(self.fatal))
            raise NotConnected(f"{self.target.label}: disconnected — retrying ({self.status.retries})")
        return self._conn

    # -------------------------------------------------------------------------------- channels
    @property
    def sessions_in_use(self) -> int:
        return self._in_use

    async def _acquire(self) -> None:
        await self._slots.acquire()
        self._in_use += 1

    def _release(self) -> None:
        self._in_use -= 1
        self._slots.release()

    def _channel_error(self, exc: BaseException) -> SshError:
        if self._conn is None or self._conn.is_closed():
            return NotConnected(f"{self.target.label}: connection lost ({exc or type(exc).__name__})")
        if isinstance(exc, asyncssh.ChannelOpenError):
            return SshError(
                f"{self.target.label}: the server refused a new channel ({exc.reason}); its MaxSessions "
                f"may be below [executor] options.max_sessions = {self.target.max_sessions}"
            )
        if isinstance(exc, asyncssh.ConnectionLost | asyncssh.DisconnectError | OSError):
            return NotConnected(f"{self.target.label}: connection lost ({exc or type(exc).__name__})")
        return SshError(f"{self.target.label}: {exc}")

    async def _open_retrying(self, open_fn: Callable[[], Any]) -> Any:
        """Open a channel, retrying briefly when the server refuses it.

        A refused open never ran anything, so retrying is safe. It happens at the limit: the
        server frees a session slot a moment after the client has seen the channel close.
        """
        delay = 0.02
        for attempt in range(CHANNEL_OPEN_TRIES):
            try:
                return await open_fn()
            except asyncssh.ChannelOpenError:
                if attempt == CHANNEL_OPEN_TRIES - 1 or self._conn is None or self._conn.is_closed():
                    raise
                await asyncio.sleep(delay)
                delay *= 2

    async def run(self, command: str, input: str | None = None, timeout_s: float | None = 120.0) -> RunResult:
        """Run one command (through the remote user's shell) on its own channel."""
        conn = self._require()
        await self._acquire()
        try:
            r = await self._open_retrying(
                lambda: conn.run(command, input=input, check=False, timeout=timeout_s)
            )
        except asyncssh.TimeoutError:
            raise SshError(
                f"{self.target.label}: `{command[:80]}` did not finish within {timeout_s:g}s"
            ) from None
        except (asyncssh.Error, OSError) as exc:
            raise self._channel_error(exc) from None
        finally:
            self._release()
        rc = r.exit_status if r.exit_status is not None else 255
        return RunResult(rc, str(r.stdout or ""), str(r.stderr or ""))

    async def open_process(self, command: str) -> tuple[asyncssh.SSHClientProcess, Callable[[], None]]:
        """A long-lived process channel (bytes I/O); call the returned function once when done with it."""
        conn = self._require()
        await self._acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release()

        try:
            proc = await self._open_retrying(lambda: conn.create_process(command, encoding=None))
        except (asyncssh.Error, OSError) as exc:
            release()
            raise self._channel_error(exc) from None
        except BaseException:  # cancelled while opening: give the slot back
            release()
            raise
        return proc, release

    @contextlib.asynccontextmanager
    async def sftp(self) -> AsyncIterator[asyncssh.SFTPClient]:
        conn = self._require()
        await self._acquire()
        try:
            try:
                client = await self._open_retrying(conn.start_sftp_client)
            except (asyncssh.Error, OSError) as exc:
                raise self._channel_error(exc) from None
            async with client:
                yield client
        finally:
            self._release()

    async def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.wait_closed()
        self.status.state = "disconnected"
        self.status.detail = "closed"

    async def __aenter__(self) -> HostConnection:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def remote_env_prefix(pythonpath: str | None) -> str:
    """Shell words that put ``pythonpath`` first on the remote ``PYTHONPATH`` (POSIX shells)."""
    if not pythonpath:
        return ""
    return f'env PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}" '


def remote_python(python: str, pythonpath: str | None, *argv: str) -> str:
    """The command line that runs ``python *argv`` on the host with Aerie's ``pipeline`` importable."""
    return f"cd / && exec {remote_env_prefix(pythonpath)}{shlex.quote(python)} " + " ".join(
        shlex.quote(a) for a in argv
    )
