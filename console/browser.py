"""Browser mode: ``aerie serve RUN`` serves the console to a web browser through textual-serve.

Each browser tab gets its own console process (``aerie attach RUN``, run by textual-serve with its
web driver), so it is the same console — board, log viewer, actions — attached like any other; the
stages never depend on it. The server binds to the loopback interface only: the console can kill
stages and has no login, so it is reached through an SSH port-forward
(``ssh -L 8000:127.0.0.1:8000 login-node``, see docs/operating.md), never exposed on a network.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ServeError(ValueError):
    pass


def check_loopback(host: str) -> str:
    """``host`` if every address it names is a loopback address; else a :class:`ServeError`."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot resolve it: {exc}") from None
    addrs = {info[4][0] for info in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ServeError(f"--host {host}: not a loopback address ({', '.join(sorted(addrs))}). The console can kill "
                         "stages and has no login: serve it on 127.0.0.1 and reach it through an SSH port-forward "
                         "(ssh -L 8000:127.0.0.1:8000 HOST)")
    return host


def console_command(run: str, theme: str | None, poll_s: float) -> str:
    """The shell command textual-serve runs for each browser session."""
    argv = [sys.executable, "-m", "console.cli", "attach", run, "--poll", f"{poll_s:g}"]
    if theme:
        argv += ["--theme", theme]
    return shlex.join(argv)


def serve(run: str, host: str, port: int, theme: str | None, poll_s: float) -> int:
    """Serve until interrupted (Ctrl-C); returns the exit code."""
    from textual_serve.server import Server

    check_loopback(host)
    # The per-session console imports `console` from this checkout, whatever the browser's cwd.
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                           else "")
    server = Server(console_command(run, theme, poll_s), host=host, port=port, title=f"Aerie — {run}")
    print(f"aerie serve: the console for {run} at http://{host}:{port}/ (Ctrl-C stops serving; "
          "the run keeps going)", file=sys.stderr, flush=True)
    server.serve()
    return 0
