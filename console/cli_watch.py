"""``aerie watch RUN``'s command line: which run (local or ``ssh://``), which hooks (``--command``, else the user's
config ``[alerts] command``), then :mod:`console.watch` follows the run's alert records and runs them."""

from __future__ import annotations

import argparse

from console.cli_common import EXIT_USAGE, aerie_home, err, open_run, remote
from console.transport import LocalTransport


def cmd_watch(args: argparse.Namespace) -> int:
    """``aerie watch RUN``: run the user's own hooks for the run's alerts, from anywhere (console.watch)."""
    import asyncio

    from console.settings import read_user_config
    from console.watch import run_watch

    if remote(args.run):
        from console.ssh.commands import attach_transport

        t = attach_transport(args.run)
        if isinstance(t, int):
            return t
        transport, key = t, args.run
    else:
        run = open_run(args.run)
        if run is None:
            return EXIT_USAGE
        transport, key = LocalTransport(str(run.root)), f"local:{run.root.resolve()}"
    user, problems = read_user_config()
    for p in problems:
        err(p)
    raw = user.get("alerts")
    section: dict = raw if isinstance(raw, dict) else {}
    hooks = list(args.command) or ([section["command"]] if isinstance(section.get("command"), str) else [])
    timeout = args.timeout or float(section.get("timeout_s") or 30.0)
    try:
        return asyncio.run(
            run_watch(transport, key, aerie_home(), hooks, timeout, args.poll, args.until_done)
        )
    except KeyboardInterrupt:
        return 130


def add_watch_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """watch: the headless notifier (the user's own hooks, run here, for the run's alerts)."""
    p = sub.add_parser(
        "watch", help="follow a run's alerts and run your own hooks for each, once (local or ssh://)"
    )
    p.add_argument("run")
    p.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="CMD",
        help="a hook to run per alert (repeatable; default: [alerts] command of your config)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds a hook may run (default: config, 30)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between reads of the run's alerts")
    p.add_argument(
        "--until-done",
        action="store_true",
        help="exit once the run has finished and every alert is delivered",
    )
    p.set_defaults(fn=cmd_watch)
