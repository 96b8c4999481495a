"""Browser mode: ``aerie serve RUN`` serves the console to a web browser through textual-serve.

Each browser tab gets its own console process (``aerie attach RUN``, run by textual-serve with its
web driver), so it is the same console — board, log viewer, actions — attached like any other; the
stages never depend on it. The server binds to the loopback interface only: the console can kill
stages, so it is reached through an SSH port-forward (``ssh -L 8000:127.0.0.1:8000 login-node``, see
docs/operating.md), never exposed on a network — unless the operator says so explicitly
(``--allow-remote``).

Who may use it is ``console/serve_guard.py``'s job: every request is checked for its Host (DNS
rebinding), its Origin (other web pages) and a token, which is required by default, on loopback too
(generated into a 0600 file when the operator gives none; ``--no-token`` opts out, loopback only); no
token reaches a log. At most ``--max-sessions`` consoles run at once (a console is a process, ~50 MB):
past that, ``/`` and ``/ws`` answer 503 and no process is started.

Watchers: ``--read-only`` makes every browser console a read-only one (``aerie attach --read-only``:
everything shown, every control key refused, nothing sent). With a second, view-only token
(``--view-token-file`` or ``$AERIE_SERVE_VIEW_TOKEN``) one server serves both: the token a session
presents picks its console — the control token a full one, the view token a read-only one. There is no
HTTP control endpoint to guard: control is keys typed into the session's console process, so a view
token's console is started read-only.

No console outlives the server, however the server ends and however the browser went away: each
console runs in its own process group, recorded when it is started; the server sends that group
SIGTERM (then SIGKILL) when it shuts down, and the kernel sends the console SIGKILL if the server
dies without shutting down (``PR_SET_PDEATHSIG``, so even a SIGKILLed server leaves no orphan).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hmac
import ipaddress
import logging
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from console import serve_guard
from console.serve_guard import (
    NO_TOKEN_RISK,
    READ_ONLY_KEY,
    TOKEN_ENV,
    VIEW_TOKEN_ENV,
    Guard,
    GuardError,
    RedactingFilter,
    read_token,
    view_token,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MAX_SESSIONS = 4


ServeError = GuardError  # what makes `aerie serve` refuse to start: one line, exit 2


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


def console_command(run: str, theme: str | None, poll_s: float, read_only: bool = False) -> str:
    """The shell command textual-serve runs for each browser session (its actions audited as ``browser``)."""
    argv = [sys.executable, "-m", "console.cli", "attach", run, "--poll", f"{poll_s:g}", "--via", "browser"]
    if theme:
        argv += ["--theme", theme]
    if read_only:
        argv.append("--read-only")
    return shlex.join(argv)


_PR_SET_PDEATHSIG = 1


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
    title: str,
    guard: Guard,
    groups: ConsoleGroups,
    view_command: str | None = None,
) -> Any:
    """A textual-serve Server behind ``guard`` (serve_guard.py) whose consoles are recorded, own their
    group, die with it, and number at most ``guard.max_sessions``. A session whose token is read-only runs
    ``view_command`` (the read-only console) instead of ``command``."""
    import aiohttp_jinja2
    from aiohttp import web
    from rich.console import Console
    from textual_serve.app_service import AppService
    from textual_serve.server import Server

    class _AppService(AppService):
        async def _open_app_process(self, width: int = 80, height: int = 24) -> asyncio.subprocess.Process:
            env = self._build_environment(width=width, height=height)
            for name in (TOKEN_ENV, VIEW_TOKEN_ENV):  # a console (and its alert hooks) never sees a token
                env.pop(name, None)
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
        def initialize_logging(self) -> None:
            # Plain lines on stderr, each through the token filter; no rich tracebacks (they show locals).
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("aerie serve: %(name)s: %(message)s"))
            handler.addFilter(RedactingFilter(guard.tokens))
            logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)

        async def on_startup(self, app: web.Application) -> None:
            pass  # textual-serve's banner names a URL and the command; serve() says what the operator needs

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            app.middlewares.append(serve_guard.middleware(guard))
            app.on_response_prepare.append(serve_guard.safe_headers)
            app.on_shutdown.append(lambda _app: asyncio.to_thread(groups.stop_all))
            return app

        async def handle_index(self, request: web.Request) -> web.StreamResponse:
            if guard.full:
                raise web.HTTPServiceUnavailable(text=guard.full_text(), headers={"Retry-After": "30"})
            # The websocket URL as the browser reached us (Host checked by the guard): the page works
            # at localhost or 127.0.0.1, and through a forward to another local port (--allow-origin).
            scheme = "wss" if request.scheme == "https" or guard.behind_tls(request.host) else "ws"
            context = {
                "font_size": _to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": f"{scheme}://{request.host}/ws",
                "config": {"static": {"url": "/static/"}},
                "application": {"name": self.title},
            }
            return aiohttp_jinja2.render_template("app_index.html", request, context)

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            # textual-serve's handler, with our AppService (recorded group, death signal) and the cap.
            if guard.full:  # refused before the upgrade: no console process is started for it
                raise web.HTTPServiceUnavailable(text=guard.full_text(), headers={"Retry-After": "30"})
            guard.sessions += 1
            try:
                return await self._session(request)
            finally:
                guard.sessions -= 1

        async def _session(self, request: web.Request) -> web.WebSocketResponse:
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
                print(
                    f"aerie serve: a session failed: {guard.redact(repr(error))}", file=sys.stderr, flush=True
                )
            finally:
                if app_service is not None:
                    await app_service.stop()
            return websocket

        def serve_on(self, socks: list[socket.socket]) -> None:
            """textual-serve's ``serve``, on sockets already bound, with the redacting access log."""
            from aiohttp.web_runner import GracefulExit

            self.initialize_logging()
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)

            def request_exit() -> None:
                raise GracefulExit()

            loop.add_signal_handler(signal.SIGINT, request_exit)
            loop.add_signal_handler(signal.SIGTERM, request_exit)
            web.run_app(
                self._make_app(),
                sock=socks,
                handle_signals=False,
                loop=loop,
                print=None,
                access_log_class=serve_guard.access_logger_class(guard.tokens),
            )

    server = _Server(command, host=guard.bound, port=guard.port, title=title)
    server.console = Console(stderr=True)
    return server


def _to_int(value: str, default: int) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names, before anything is printed or written: a busy
    port is one line (:class:`ServeError`), and a second server never touches the first one's token file."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot resolve it: {exc}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _name, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp: TIME_WAIT is no obstacle
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
    except OSError as exc:
        for sock in socks:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(
                f"port {port} on {host} is already in use: is another aerie serve running? pick --port"
            ) from None
        raise ServeError(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    return socks


def _say(text: str) -> None:
    print(f"aerie serve: {text}", file=sys.stderr, flush=True)


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
    no_token: bool = False,
    allow_origins: tuple[str, ...] = (),
    max_sessions: int = DEFAULT_MAX_SESSIONS,
) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM); returns the exit code."""
    if not allow_remote:
        check_loopback(host)
    if max_sessions < 1:
        raise ServeError(f"--max-sessions {max_sessions}: must be at least 1")
    try:
        origins = tuple(serve_guard.normalize_origin(o) for o in allow_origins)
    except serve_guard.GuardError as exc:
        raise ServeError(f"--allow-origin {exc}") from None
    view = view_token(view_token_file)
    if view is not None and read_only:
        raise ServeError(
            "--view-token-file with --read-only: every console is read-only already; give the token with "
            "--token-file (or $AERIE_SERVE_TOKEN)"
        )
    control = read_token(token_file)
    if no_token:
        if not is_loopback(host):
            raise ServeError(
                "--no-token is only allowed on a loopback address: off loopback the token is the guard"
            )
        if control is not None or view is not None:
            raise ServeError(
                "--no-token with a token (--token-file, --view-token-file or $AERIE_SERVE_*TOKEN)"
            )
    elif control is not None and view is not None and hmac.compare_digest(control.encode(), view.encode()):
        raise ServeError("the view-only token must differ from the control token")

    socks = bind(host, port)  # a busy port ends here, before a URL is printed or a token file written
    port = socks[0].getsockname()[1]  # --port 0: the one the kernel chose
    generated: Path | None = None
    try:
        if no_token:
            hint = ""
        elif control is not None:
            hint = f"its token: the one in {token_file}" if token_file else f"its token: ${TOKEN_ENV}"
        else:
            generated = serve_guard.token_path(host, port)
            control = serve_guard.write_token(generated)
            hint = f"its token: cat {generated}"
        tokens: dict[str, bool] = {}
        if control is not None:
            tokens[control] = read_only
        if view is not None:
            tokens[view] = True
        wildcard = ipaddress.ip_address(socks[0].getsockname()[0]).is_unspecified
        guard = Guard(port, host, origins, tokens, allow_remote and wildcard, max_sessions, hint)
        # The per-session console imports `console` from this checkout, whatever the browser's cwd.
        os.environ["PYTHONPATH"] = str(ROOT) + (
            os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
        )
        groups = ConsoleGroups()
        server = make_server(
            console_command(run, theme, poll_s, read_only),
            f"Aerie — {run}" + (" (read-only)" if read_only else ""),
            guard,
            groups,
            view_command=console_command(run, theme, poll_s, read_only=True),
        )
        kind = "read-only console" if read_only else "console"
        where = f"http://{serve_guard.url_host(host)}:{port}/"
        _say(f"the {kind} for {run} at {where} (Ctrl-C stops serving; the run keeps going)")
        if no_token:
            _say(NO_TOKEN_RISK)
        else:
            _say(f"{hint} (the page asks for it once, or add ?token=...; a cookie keeps it)")
        if view is not None:
            _say(
                f"view-only: the token in {view_token_file or '$' + VIEW_TOKEN_ENV} gets a read-only console"
            )
        if not is_loopback(host) and not read_only:
            _say(
                f"WARNING: serving on {host}, not loopback: anyone who has the control token can kill stages"
            )
        try:
            server.serve_on(socks)
        finally:
            groups.stop_all()  # whatever ended the server: no console outlives it
    finally:
        for sock in socks:
            sock.close()
        if generated is not None and control is not None:
            serve_guard.remove_token(generated, control)
    return 0
