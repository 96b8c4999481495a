"""``aerie serve``: its arguments and the command that starts the browser console (console/browser.py)."""

from __future__ import annotations

import argparse

from console.cli_common import EXIT_USAGE, err, open_run, remote


def bad_theme(theme: str) -> bool:
    from textual.theme import BUILTIN_THEMES

    from themes import load_themes

    known = [*load_themes(), *BUILTIN_THEMES]
    if theme in known:
        return False
    err(f"--theme {theme}: unknown theme (known: {', '.join(known)})")
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    from console.browser import ServeError, serve

    if not remote(args.run) and open_run(args.run) is None:
        return EXIT_USAGE
    if args.theme and bad_theme(args.theme):
        return EXIT_USAGE
    try:
        return serve(
            args.run,
            args.host,
            args.port,
            args.theme,
            args.poll,
            allow_remote=args.allow_remote,
            token_file=args.token_file,
            read_only=args.read_only,
            view_token_file=args.view_token_file,
            no_token=args.no_token,
            allow_origins=tuple(args.allow_origin),
            max_sessions=args.max_sessions,
        )
    except ServeError as exc:
        err(str(exc))
        return EXIT_USAGE


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """serve: the console in a web browser, and who may drive it."""
    p = sub.add_parser(
        "serve", help="serve the console to a web browser on 127.0.0.1 (use an SSH port-forward)"
    )
    p.add_argument("run")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--theme", default=None, help="console theme")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between reads of the run directory")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host; every request then needs the token",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding the token a console needs, pasted into the page once: no cookie, never in a URL "
        "(else $AERIE_SERVE_TOKEN, else a random one, written to a 0600 file whose path is printed)",
    )
    p.add_argument(
        "--no-token",
        action="store_true",
        help="loopback only: no token; every local account can then drive the console (says what it risks)",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="URL",
        help="also accept pages and Host of this origin, e.g. http://localhost:9000 for an SSH forward "
        "to another local port (repeatable)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=4,
        metavar="N",
        help="browser consoles at once (each a process); past it a clear refusal (default 4); view-token "
        "watchers get all but one: the last is the control token's",
    )
    p.add_argument(
        "--read-only",
        action="store_true",
        help="every browser console only watches: control actions are refused",
    )
    p.add_argument(
        "--view-token-file",
        default=None,
        help="file holding a second, view-only token (else $AERIE_SERVE_VIEW_TOKEN): its holders get a "
        "read-only console, holders of the control token a full one; every request then needs a token",
    )
    p.set_defaults(fn=cmd_serve)
