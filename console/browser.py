"""Browser mode: ``aerie serve RUN`` serves the console to a web browser through textual-serve.

Each browser tab gets its own console process (``aerie attach RUN``, run by textual-serve with its
web driver), so it is the same console — board, log viewer, actions — attached like any other; the
stages never depend on it. The server binds to the loopback interface only: the console can kill
stages and has no login, so it is reached through an SSH port-forward
(``ssh -L 8000:127.0.0.1:8000 login-node``, see docs/operating.md), never exposed on a network —
unless the operator says so explicitly (``--allow-remote``), and then every request must carry a
token (``?token=`` once, then an HttpOnly cookie).

Watchers: ``--read-only`` makes every browser console a read-only one (``aerie attach --read-only``:
everything shown, every control key refused, nothing sent). With a second, view-only token
(``--view-token-file`` or ``$AERIE_SERVE_VIEW_TOKEN``) one server serves both: every request needs a
token (on loopback too), and the token a session presents picks its console — the control token a
full one, the view token a read-only one. There is no HTTP control endpoint to guard: control is keys
typed into the session's console process, so a view token's console is started read-only.

No console outlives the server, however the server ends and however the browser went away: each
console runs in its own process group, recorded when it is started; the server sends that group
SIGTERM (then SIGKILL) when it shuts down, and the kernel sends the console SIGKILL if the server
dies without shutting down (``PR_SET_PDEATHSIG``, so even a SIGKILLed server leaves no orphan).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import ipaddress
import os
import secrets
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class ServeError(ValueError):
    pass


def check_loopback(host: str) -> str:
    """``host`` if every address it names is a loopback address; else a :class:`ServeError`."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot resolve it: {exc}") from None
    addrs = {str(info[4][0]) for info in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ServeError(
            f"--host {host}: not a loopback address ({', '.join(sorted(addrs))}). The console can kill "
            "stages and has no login: serve it on 127.0.0.1 and reach it through an SSH port-forward "
            "(ssh -L 8000:127.0.0.1:8000 HOST); to expose it anyway pass --allow-remote, and every "
            "request will then need a token"
        )
    return host


def is_loopback(host: str) -> bool:
    try:
        check_loopback(host)
    except ServeError:
        return False
    return True


def read_token(
    token_file: str | None, env: str = "AERIE_SERVE_TOKEN", flag: str = "--token-file"
) -> tuple[str, bool]:
    """The access token and whether it was generated here: from ``token_file``, else ``$env``,
    else a fresh random one (printed once, with the URL, to the operator's terminal)."""
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ServeError(f"{flag} {token_file}: cannot read the token: {exc.strerror or exc}") from None
        if len(token) < 16:
            raise ServeError(f"{flag} {token_file}: the token must be at least 16 characters")
        return token, False
    if os.environ.get(env):
        token = os.environ[env].strip()
        if len(token) < 16:
            raise ServeError(f"{env}: the token must be at least 16 characters")
        return token, False
    return secrets.token_urlsafe(24), True


def view_token(view_token_file: str | None) -> str | None:
    """The view-only token, when the operator gave one (``--view-token-file``, ``$AERIE_SERVE_VIEW_TOKEN``)."""
    if not view_token_file and not os.environ.get("AERIE_SERVE_VIEW_TOKEN"):
        return None
    return read_token(view_token_file, "AERIE_SERVE_VIEW_TOKEN", "--view-token-file")[0]


def console_command(run: str, theme: str | None, poll_s: float, read_only: bool = False) -> str:
    """The shell command textual-serve runs for each browser session (its actions audited as ``browser``)."""
    argv = [sys.executable, "-m", "console.cli", "attach", run, "--poll", f"{poll_s:g}", "--via", "browser"]
    if theme:
        argv += ["--theme", theme]
    if read_only:
        argv.append("--read-only")
    return shlex.join(argv)


_PR_SET_PDEATHSIG = 1
COOKIE = "aerie_token"
READ_ONLY_KEY = "aerie_read_only"  # the request's role, set by the token gate


def _child_setup(parent: int) -> None:
    """In the console child before exec: SIGKILL when the server dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the server died before prctl took effect
        os._exit(1)


class ConsoleGroups:
    """The process groups of the consoles this server started, recorded at start; only these are signalled."""

    def __init__(self) -> None:
        self.procs: dict[int, asyncio.subprocess.Process] = {}

    def add(self, proc: asyncio.subprocess.Process) -> None:
        self.procs[proc.pid] = proc

    def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every recorded group still running, SIGKILL what is left after ``grace_s``.

        Safe against pid reuse: a recorded child is not reaped until asyncio sees it exit, so while
        ``returncode`` is None its pid (= its group id) is still ours."""
        live = [p for p in self.procs.values() if p.returncode is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in live:
                for s in (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, s)
            deadline = time.monotonic() + grace_s
            while (
                sig == signal.SIGTERM
                and time.monotonic() < deadline
                and any(_group_alive(p.pid) for p in live)
            ):
                time.sleep(0.05)
        self.procs.clear()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # a zombie leader (not reaped yet) still answers; count the group dead when only zombies remain
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def make_server(
    command: str,
    host: str,
    port: int,
    title: str,
    tokens: dict[str, bool] | None,
    groups: ConsoleGroups,
    view_command: str | None = None,
) -> Any:
    """A textual-serve Server whose consoles are recorded, own their group, die with it, and (with
    ``tokens``: token -> read-only) that answers only requests carrying one of them. A session whose
    token is read-only runs ``view_command`` (the read-only console) instead of ``command``."""
    from aiohttp import web
    from textual_serve.app_service import AppService
    from textual_serve.server import Server

    class _AppService(AppService):
        async def _open_app_process(self, width: int = 80, height: int = 24) -> asyncio.subprocess.Process:
            env = self._build_environment(width=width, height=height)
            parent = os.getpid()
            # exec: the shell becomes the console, so the recorded pid is the console itself.
            self._process = process = await asyncio.create_subprocess_shell(
                f"exec {self.command}",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: _child_setup(parent),
            )
            groups.add(process)
            assert process.stdin is not None
            self._stdin = process.stdin
            return process

    class _Server(Server):
        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            if tokens:
                app.middlewares.append(_token_gate(tokens))
            app.on_shutdown.append(lambda _app: asyncio.to_thread(groups.stop_all))
            return app

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            # textual-serve's handler, with our AppService (recorded group, death signal).
            websocket = web.WebSocketResponse(heartbeat=15)
            width = _to_int(request.query.get("width", "80"), 80)
            height = _to_int(request.query.get("height", "24"), 24)
            app_service: AppService | None = None

            async def close() -> None:  # textual-serve awaits None; aiohttp's close says whether it closed
                await websocket.close()

            try:
                await websocket.prepare(request)
                read_only = bool(request.get(READ_ONLY_KEY)) and view_command is not None
                app_service = _AppService(
                    view_command if read_only and view_command else self.command,
                    write_bytes=websocket.send_bytes,
                    write_str=websocket.send_str,
                    close=close,
                    download_manager=self.download_manager,
                    debug=self.debug,
                )
                await app_service.start(width, height)
                try:
                    await self._process_messages(websocket, app_service)
                finally:
                    await app_service.stop()
            except asyncio.CancelledError:
                await websocket.close()
            except Exception as error:  # noqa: BLE001 - as textual-serve: log, never crash the server
                print(f"aerie serve: a session failed: {error!r}", file=sys.stderr, flush=True)
            finally:
                if app_service is not None:
                    await app_service.stop()
            return websocket

    return _Server(command, host=host, port=port, title=title)


def _to_int(value: str, default: int) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def _token_gate(tokens: dict[str, bool]) -> Any:
    """Middleware: a request needs one of ``tokens`` (query, cookie or bearer); its role (read-only or
    not) is put on the request for the websocket handler."""
    from aiohttp import web

    known = [(t.encode(), ro) for t, ro in tokens.items()]

    @web.middleware
    async def gate(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.query.get("token") or request.cookies.get(COOKIE) or ""
        auth = request.headers.get("Authorization", "")
        if not given and auth.startswith("Bearer "):
            given = auth[7:]
        role = None
        for expected, ro in known:  # every token compared, in constant time each
            if hmac.compare_digest(given.encode(), expected):
                role = ro
        if role is None:
            raise web.HTTPUnauthorized(
                text="aerie serve: this console needs its token (open the URL with "
                "?token=... that aerie serve printed)\n"
            )
        request[READ_ONLY_KEY] = role
        resp = await handler(request)
        if request.query.get("token") and not resp.prepared:
            resp.set_cookie(COOKIE, given, httponly=True, samesite="Strict")
        return resp

    return gate


def serve(
    run: str,
    host: str,
    port: int,
    theme: str | None,
    poll_s: float,
    allow_remote: bool = False,
    token_file: str | None = None,
    read_only: bool = False,
    view_token_file: str | None = None,
) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM); returns the exit code."""
    if not allow_remote:
        check_loopback(host)
    view = view_token(view_token_file)
    if view is not None and read_only:
        raise ServeError(
            "--view-token-file with --read-only: every console is read-only already; give the token with "
            "--token-file (or $AERIE_SERVE_TOKEN)"
        )
    tokens: dict[str, bool] = {}
    generated = False
    control: str | None = None
    if view is not None or not is_loopback(host):
        control, generated = read_token(token_file)
        if view is not None and hmac.compare_digest(control.encode(), view.encode()):
            raise ServeError("the view-only token must differ from the control token")
        tokens[control] = read_only
        if view is not None:
            tokens[view] = True
    # The per-session console imports `console` from this checkout, whatever the browser's cwd.
    os.environ["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    )
    groups = ConsoleGroups()
    server = make_server(
        console_command(run, theme, poll_s, read_only),
        host,
        port,
        f"Aerie — {run}" + (" (read-only)" if read_only else ""),
        tokens or None,
        groups,
        view_command=console_command(run, theme, poll_s, read_only=True),
    )
    where = f"http://{host}:{port}/"
    kind = "read-only console" if read_only else "console"
    if control is not None:
        if not read_only and not is_loopback(host):
            print(
                f"aerie serve: WARNING: serving on {host}, not loopback: anyone who has the control token "
                "can kill stages",
                file=sys.stderr,
                flush=True,
            )
        where += f"?token={control}" if generated else "?token=<the token from your token file>"
    print(
        f"aerie serve: the {kind} for {run} at {where} (Ctrl-C stops serving; the run keeps going)",
        file=sys.stderr,
        flush=True,
    )
    if view is not None:
        print(
            f"aerie serve: view-only: http://{host}:{port}/?token=<the token from your view token file> "
            "gets a read-only console",
            file=sys.stderr,
            flush=True,
        )
    try:
        server.serve()
    finally:
        groups.stop_all()  # whatever ended the server: no console outlives it
    return 0
