"""The textual-serve server behind ``aerie serve`` (``console/browser.py``), and the console processes it starts.

:class:`GuardedServer` is textual-serve's Server with ``console/serve_guard.py`` in front of every request (Host,
Origin, token or the page's session key), the session slots checked before a WebSocket upgrade is served (one
console per session key: a newer page with the key replaces the older console), the login at ``/session``, the
page told whether the user opened its tab (``Sec-Fetch-Site``: a tab another page opened waits for a click,
``console/serve_page.py``), and
every log line (its own and aiohttp's access log) through the filter of ``console/serve_log.py``. Each
WebSocket session runs one console process through :class:`RecordedAppService`: the token variables are dropped
from its environment, the control or the read-only console is picked by the credential the session presented,
and the process is recorded in
:class:`ConsoleGroups`.

No console outlives the server, however the server ends and however the browser went away: each console runs
in its own process group, recorded when it is started; the server sends that group SIGTERM (then SIGKILL) when
it shuts down, and the kernel sends the console SIGKILL if the server dies without shutting down
(``PR_SET_PDEATHSIG``, so even a SIGKILLed server leaves no orphan).

Imported only when ``aerie serve`` starts a server: it pulls in aiohttp and textual-serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp_jinja2
from aiohttp import WSCloseCode, web
from rich.console import Console
from textual_serve.app_service import AppService
from textual_serve.server import Server

from console import serve_guard
from console.serve_guard import ROLE_KEY, TOKEN_ENV, VIEW_TOKEN_ENV, Guard, Role
from console.serve_log import EscapingStream, RedactingFilter, access_logger_class
from console.serve_page import opened_directly, with_login

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
        self.closing = False

    def add(self, proc: asyncio.subprocess.Process) -> None:
        """Record a console's group; one started while the server stops (a session that raced the shutdown)
        is killed at once, else its session would hold the shutdown until the console exits by itself."""
        self.procs[proc.pid] = proc
        if self.closing:  # set before stop_all reads procs: one of the two always sees the other
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every recorded group still running, SIGKILL what is left after ``grace_s``.

        Safe against pid reuse: a recorded child is not reaped until asyncio sees it exit, so while
        ``returncode`` is None its pid (= its group id) is still ours."""
        self.closing = True
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


STOP_BOUND_S = 20.0  # the longest ``aerie serve`` takes to end once asked to stop


def _stop_bound(loop: asyncio.AbstractEventLoop, last_words: Callable[[], None]) -> None:
    """Armed by the first stop signal: if the process is still here after :data:`STOP_BOUND_S`, log what its
    tasks still wait on, run ``last_words`` and exit (as a service manager's stop timeout would, but with the
    token file removed)."""
    time.sleep(STOP_BOUND_S)
    log = logging.getLogger("aerie.serve")
    with contextlib.suppress(Exception):  # best effort, from another thread: the loop is stuck in a wait
        waits = [_awaiting(t.get_coro()) for t in asyncio.all_tasks(loop)]
        log.warning(
            "a session did not end within %gs of the stop (waiting: %s): exiting", STOP_BOUND_S, waits
        )
    with contextlib.suppress(Exception):
        last_words()
    os._exit(0)


def _awaiting(coro: Any) -> str:
    """'handler:12 > _session:40 > close:7' — the chain of coroutines a stuck task is suspended in."""
    names: list[str] = []
    while coro is not None and len(names) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        names.append(
            f"{getattr(coro, '__qualname__', type(coro).__name__)}:{frame.f_lineno if frame else '?'}"
        )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(names)


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


def _to_int(value: str, default: int) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def _refuse_when_full(guard: Guard, role: Role) -> None:
    """503 (retry in 30 s) when no slot is free for ``role`` (serve_guard.Slots): nothing is started for it."""
    problem = guard.slots.problem(role)
    if problem:
        raise web.HTTPServiceUnavailable(text=problem, headers={"Retry-After": "30"})


class RecordedAppService(AppService):
    """textual-serve's AppService whose console process sees no token, owns its process group, dies with the
    server and is recorded in ``groups``."""

    def __init__(self, command: str, groups: ConsoleGroups, **kwargs: Any) -> None:
        super().__init__(command, **kwargs)
        self.groups = groups

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
        self.groups.add(process)
        assert process.stdin is not None
        self._stdin = process.stdin
        return process


class GuardedServer(Server):
    """A textual-serve Server behind ``guard`` (serve_guard.py) whose consoles are recorded in ``groups``, own
    their group, die with it, and number at most ``guard.max_sessions``. A session whose token is read-only
    runs ``view_command`` (the read-only console) instead of ``command``."""

    def __init__(
        self,
        command: str,
        title: str,
        guard: Guard,
        groups: ConsoleGroups,
        view_command: str | None = None,
    ) -> None:
        super().__init__(command, host=guard.bound, port=guard.port, title=title)
        self.console = Console(stderr=True)  # textual-serve's own messages on stderr, never stdout
        self.guard = guard
        self.groups = groups
        self.view_command = view_command
        self.by_key: dict[str, tuple[web.WebSocketResponse, asyncio.Event]] = {}  # the console of each key
        self.open_sockets: set[web.WebSocketResponse] = set()  # every session's, closed when the server stops

    def initialize_logging(self) -> None:
        # Plain lines on stderr, each through the token filter; no rich tracebacks (they show locals).
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("aerie serve: %(name)s: %(message)s"))
        handler.addFilter(RedactingFilter(self.guard.tokens))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)

    async def on_startup(self, app: web.Application) -> None:
        pass  # textual-serve's banner names a URL and the command; serve() says what the operator needs

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.router.add_route("*", "/session", self.handle_session)
        app.router.add_get("/ws/{key}", self.handle_websocket)
        app.middlewares.append(serve_guard.middleware(self.guard))
        app.on_response_prepare.append(serve_guard.safe_headers)
        app.on_shutdown.append(self._stop_sessions)
        return app

    async def _stop_sessions(self, _app: web.Application) -> None:
        """On shutdown: stop every console this server started and close every session's socket ("going
        away"), so no session handler is left for aiohttp to wait out (its ``shutdown_timeout``: 60 s)."""
        closing = [
            ws.close(code=WSCloseCode.GOING_AWAY, message=b"aerie serve stopped") for ws in self.open_sockets
        ]
        await asyncio.gather(asyncio.to_thread(self.groups.stop_all), *closing, return_exceptions=True)

    async def handle_index(self, request: web.Request) -> web.StreamResponse:
        # The same page for everyone, holding no secret: its script logs in and points the terminal at
        # /ws/<session key> (serve_page.py). The title names the run only once logged in. Only whether the
        # user opened the tab (Sec-Fetch-Site) varies: a tab another page opened waits for a click.
        context = {
            "font_size": _to_int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": "",
            "config": {"static": {"url": "/static/"}},
            "application": {"name": "Aerie"},
        }
        page = aiohttp_jinja2.render_string("app_index.html", request, context)
        direct = opened_directly(request.headers.get("Sec-Fetch-Site"))  # typed, or a reload: no click needed
        return web.Response(text=with_login(page, direct), content_type="text/html")

    async def handle_session(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        response: web.StreamResponse = await serve_guard.session_answer(self.guard, request, self.title)
        return response

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        # textual-serve's handler, with our AppService (recorded group, death signal) and the slots.
        role: Role = request[ROLE_KEY]
        key = request.match_info.get("key")  # a page's session key: one console per key (per tab)
        if key is not None:
            await self._replace(key)
        _refuse_when_full(self.guard, role)  # refused before the upgrade: no console process is started
        self.guard.slots.take(role)
        websocket = web.WebSocketResponse(heartbeat=15)
        ended = asyncio.Event()
        if key is not None:
            self.by_key[key] = (websocket, ended)
        self.open_sockets.add(websocket)
        try:
            return await self._session(request, websocket)
        finally:
            self.open_sockets.discard(websocket)
            self.guard.slots.give_back(role)
            ended.set()
            if key is not None and self.by_key.get(key, (None,))[0] is websocket:
                del self.by_key[key]

    async def _replace(self, key: str) -> None:
        """A key is a tab's: its newer console (a reload, or a page whose tab copied the key) ends the older
        one, which frees its slot first. A page can so never hold more than one slot per login."""
        old = self.by_key.get(key)
        if old is None:
            return
        websocket, ended = old
        with contextlib.suppress(RuntimeError):  # not upgraded yet: it ends on its own below
            await websocket.close(code=4001, message=b"a newer page of this tab took its console")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended.wait(), 15)

    def _session_command(self, request: web.Request) -> str:
        """The console a session runs: the read-only one when its credential is read-only."""
        read_only = request[ROLE_KEY].read_only and self.view_command is not None
        return self.view_command if read_only and self.view_command else self.command

    async def _session(self, request: web.Request, websocket: web.WebSocketResponse) -> web.WebSocketResponse:
        width = _to_int(request.query.get("width", "80"), 80)
        height = _to_int(request.query.get("height", "24"), 24)
        app_service: AppService | None = None

        async def close() -> None:  # textual-serve awaits None; aiohttp's close says whether it closed
            await websocket.close()

        try:
            await websocket.prepare(request)
            app_service = RecordedAppService(
                self._session_command(request),
                self.groups,
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
            logging.getLogger("aerie.serve").error("a session failed: %r", error)  # redacted, escaped
        finally:
            if app_service is not None:
                await app_service.stop()
        return websocket

    def serve_on(self, socks: list[socket.socket], last_words: Callable[[], None] = lambda: None) -> None:
        """textual-serve's ``serve``, on sockets already bound, with the redacting access log.

        A stop (SIGINT, SIGTERM, SIGHUP) ends it within :data:`STOP_BOUND_S`: past that, whatever a session
        is still waiting for (aiohttp's last cancellation of tasks was seen to wait forever on a session under
        load), ``last_words`` runs (the consoles stopped, the token file removed) and the process exits 0."""
        from aiohttp.web_runner import GracefulExit

        self.initialize_logging()
        sys.stdout = EscapingStream(sys.stdout, self.guard.tokens)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        bound = threading.Thread(
            target=_stop_bound, args=(loop, last_words), name="aerie-stop-bound", daemon=True
        )

        def request_exit() -> None:
            if not bound.is_alive():
                bound.start()
            raise GracefulExit()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # each ends it cleanly: no token file left
            loop.add_signal_handler(sig, request_exit)
        web.run_app(
            self._make_app(),
            sock=socks,
            handle_signals=False,
            shutdown_timeout=10.0,  # sessions are closed on shutdown (_stop_sessions): no handler needs 60 s
            loop=loop,
            print=None,
            access_log_class=access_logger_class(self.guard.tokens),
        )
