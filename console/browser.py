"""Browser mode: ``aerie serve RUN`` serves the console to a web browser through textual-serve.

Each browser tab gets its own console process (``aerie attach RUN``, run by textual-serve with its
web driver), so it is the same console — board, log viewer, actions — attached like any other; the
stages never depend on it. The server binds to the loopback interface only: the console can kill
stages, so it is reached through an SSH port-forward (``ssh -L 8000:127.0.0.1:8000 login-node``, see
docs/operating.md), never exposed on a network — unless the operator says so explicitly
(``--allow-remote``).

Who may use it is ``console/serve_guard.py``'s job: every request is checked for its Host (DNS
rebinding), its Origin (other web pages) and a token, which is required by default, on loopback too
(generated into a 0600 file when the operator gives none; ``--no-token`` opts out, loopback only). The
browser holds no cookie: the page posts the token once and keeps a session key in its tab, which only its
own script sends (``console/serve_page.py``); no token or key reaches a log, and every log line is escaped
(``console/serve_log.py``). At most ``--max-sessions`` consoles run at once (a console is a process,
~50 MB), the last slot kept for the control token: past that, the page and ``/ws`` answer 503 and no
process is started.

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

This module is the command: the options checked, the sockets bound, the token found or generated, the
operator told where the console is. The server itself — textual-serve behind the guard, each WebSocket
session's console process and the process groups — is ``console/browser_server.py``, imported only when
a server starts (it pulls in aiohttp and textual-serve).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from console import serve_guard
from console.serve_guard import (
    NO_TOKEN_RISK,
    TOKEN_ENV,
    VIEW_TOKEN_ENV,
    Guard,
    GuardError,
    Role,
    read_token,
    view_token,
)

if TYPE_CHECKING:  # imported when a server starts: it pulls in aiohttp and textual-serve
    from console.browser_server import ConsoleGroups, GuardedServer

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


def make_server(
    command: str,
    title: str,
    guard: Guard,
    groups: ConsoleGroups,
    view_command: str | None = None,
) -> GuardedServer:
    """A textual-serve Server behind ``guard`` (serve_guard.py) whose consoles are recorded, own their
    group, die with it, and number at most ``guard.max_sessions``. A session whose token is read-only runs
    ``view_command`` (the read-only console) instead of ``command``. (console/browser_server.py)"""
    from console.browser_server import GuardedServer

    return GuardedServer(command, title, guard, groups, view_command=view_command)


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


def check_options(
    host: str,
    allow_remote: bool,
    max_sessions: int,
    allow_origins: tuple[str, ...],
    read_only: bool,
    token_file: str | None,
    view_token_file: str | None,
    no_token: bool,
) -> tuple[tuple[str, ...], str | None, str | None]:
    """The allowed origins, the control token and the view token ``serve`` was given, each checked before
    anything is bound; a :class:`ServeError` for what makes it refuse to start."""
    if not allow_remote:
        check_loopback(host)
    if max_sessions < 1:
        raise ServeError(f"--max-sessions {max_sessions}: must be at least 1")
    try:
        origins = tuple(serve_guard.normalize_origin(o) for o in allow_origins)
    except serve_guard.GuardError as exc:
        raise ServeError(f"--allow-origin {exc}") from None
    view = view_token(view_token_file)
    if view is not None and max_sessions < 2:
        raise ServeError(
            f"--max-sessions {max_sessions} with a view token: the last slot is kept for the control token, "
            "so watchers need --max-sessions 2 or more"
        )
    if view is not None and read_only:
        raise ServeError(
            "--view-token-file with --read-only: every console is read-only already; give the token with "
            "--token-file (or $AERIE_SERVE_TOKEN)"
        )
    control = read_token(token_file)
    check_token_choice(host, no_token, control, view)
    return origins, control, view


def check_token_choice(host: str, no_token: bool, control: str | None, view: str | None) -> None:
    """``--no-token`` only on loopback and with no token given; a view token that differs from the control one."""
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


def control_token(
    host: str, port: int, control: str | None, token_file: str | None, no_token: bool
) -> tuple[str | None, Path | None, str]:
    """The control token (generated into a 0600 file when none was given and ``--no-token`` was not), the file
    generated for it (None when none was), and the hint that tells the operator where the token is."""
    if no_token:
        return control, None, ""
    if control is not None:
        return (
            control,
            None,
            f"its token: the one in {token_file}" if token_file else f"its token: ${TOKEN_ENV}",
        )
    generated = serve_guard.token_path(host, port)
    return serve_guard.write_token(generated), generated, f"its token: cat {generated}"


def make_guard(
    socks: list[socket.socket],
    host: str,
    origins: tuple[str, ...],
    control: str | None,
    view: str | None,
    read_only: bool,
    allow_remote: bool,
    max_sessions: int,
    hint: str,
) -> Guard:
    """The guard of the server listening on ``socks``: each token mapped to whether its console is read-only."""
    tokens: dict[str, Role] = {}
    if control is not None:
        tokens[control] = Role(read_only=read_only)
    if view is not None:
        tokens[view] = Role(read_only=True, watcher=True)
    port = socks[0].getsockname()[1]
    wildcard = ipaddress.ip_address(socks[0].getsockname()[0]).is_unspecified
    return Guard(port, host, origins, tokens, allow_remote and wildcard, max_sessions, hint)


def export_checkout_path() -> None:
    """Put this checkout first on ``$PYTHONPATH``: the per-session console imports `console` from it,
    whatever the browser's cwd."""
    os.environ["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    )


def announce(
    run: str,
    host: str,
    port: int,
    read_only: bool,
    no_token: bool,
    hint: str,
    view: str | None,
    view_token_file: str | None,
) -> None:
    """Tell the operator where the console is, how to get in (never the token itself) and what it risks."""
    kind = "read-only console" if read_only else "console"
    where = f"http://{serve_guard.url_host(host)}:{port}/"
    _say(f"the {kind} for {run} at {where} (Ctrl-C stops serving; the run keeps going)")
    if no_token:
        _say(NO_TOKEN_RISK)
    else:
        _say(f"{hint} (paste it into the page once; that tab keeps a session key, never a cookie)")
    if view is not None:
        _say(f"view-only: the token in {view_token_file or '$' + VIEW_TOKEN_ENV} gets a read-only console")
    if not is_loopback(host) and not read_only:
        _say(f"WARNING: serving on {host}, not loopback: anyone who has the control token can kill stages")


def _exit_on_signal(signum: int, _frame: object) -> None:
    # Through every `finally` (the token file is removed), and exit 0 as a stop once serving does: a service
    # manager's SIGTERM that lands while the server starts is the same asked-for stop (CI saw 143 here).
    raise SystemExit(0)


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
    """Serve until interrupted (Ctrl-C, SIGTERM or SIGHUP); returns the exit code."""
    origins, control, view = check_options(
        host, allow_remote, max_sessions, allow_origins, read_only, token_file, view_token_file, no_token
    )
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # until the server's loop takes them
        signal.signal(sig, _exit_on_signal)
    socks = bind(host, port)  # a busy port ends here, before a URL is printed or a token file written
    port = socks[0].getsockname()[1]  # --port 0: the one the kernel chose
    generated: Path | None = None
    try:
        control, generated, hint = control_token(host, port, control, token_file, no_token)
        guard = make_guard(socks, host, origins, control, view, read_only, allow_remote, max_sessions, hint)
        export_checkout_path()
        from console.browser_server import ConsoleGroups

        groups = ConsoleGroups()
        server = make_server(
            console_command(run, theme, poll_s, read_only),
            f"Aerie — {run}" + (" (read-only)" if read_only else ""),
            guard,
            groups,
            view_command=console_command(run, theme, poll_s, read_only=True),
        )
        announce(run, host, port, read_only, no_token, hint, view, view_token_file)

        def last_words() -> None:  # a stop that took too long (GuardedServer.serve_on): as `finally` below
            groups.stop_all(grace_s=1.0)
            if generated is not None and control is not None:
                serve_guard.remove_token(generated, control)

        try:
            server.serve_on(socks, last_words)
        finally:
            groups.stop_all()  # whatever ended the server: no console outlives it
    finally:
        for sock in socks:
            sock.close()
        if generated is not None and control is not None:
            serve_guard.remove_token(generated, control)
    return 0
