"""The ``aerie`` commands' ssh side: preflight, starting a remote run, attaching to one, control.

``console/cli.py`` calls into here when the plan's executor is ``ssh`` or the run is named as
``ssh://[user@]host[:port]/path/to/run``; the console and headless mode then get an
:class:`SshTransport` instead of a local one and work unchanged. Each function runs its own short
event loop and closes its connection; the transport it returns connects lazily inside the
console's loop (asyncssh connections belong to one loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from console.ssh.adopt import adopt_layout
from console.ssh.connection import HostConnection, SshError, SshTarget, parse_ssh_url
from console.ssh.preflight import preflight
from console.ssh.transport import LayoutMissing, RemoteLayout, SshTransport, load_layout, start_remote_run
from console.transport import CtlResult, LocalTransport, Transport
from pipeline.run.plan import dag as plan_mod

EXIT_OK, EXIT_USAGE = 0, 2


def _err(text: str) -> None:
    print(f"aerie: error: {text}", file=sys.stderr)


def _load_ssh_plan(path: str) -> plan_mod.Plan | int:
    try:
        plan = plan_mod.load(path)
    except plan_mod.PlanError as exc:
        _err(str(exc))
        return EXIT_USAGE
    return plan


async def _preflight_and_start(plan: plan_mod.Plan, start: bool) -> tuple[int, RemoteLayout | None]:
    async with HostConnection(SshTarget.from_executor(plan.executor, plan.path)) as conn:
        rep = await preflight(plan, conn)
        print(rep.render(), file=sys.stderr)
        if not rep.ok or rep.layout is None:
            return EXIT_USAGE, None
        if start:
            await start_remote_run(conn, rep.layout)
        return EXIT_OK, rep.layout


def cmd_preflight(args: argparse.Namespace) -> int:
    """``aerie preflight PLAN``: bootstrap + checks only; exit 0 when the run could start."""
    plan = _load_ssh_plan(args.plan)
    if isinstance(plan, int):
        return plan
    if not plan.executor.host:
        print(
            f"{plan.path}: executor.kind = {plan.executor.kind!r}: nothing to preflight (runs on this machine)"
        )
        return EXIT_OK
    try:
        rc, _layout = asyncio.run(_preflight_and_start(plan, start=False))
    except SshError as exc:
        _err(str(exc))
        return EXIT_USAGE
    return rc


def start_remote(plan: plan_mod.Plan) -> SshTransport | int:
    """``aerie run PLAN`` for an ssh plan: preflight + bootstrap, start the remote supervisor."""
    try:
        rc, layout = asyncio.run(_preflight_and_start(plan, start=True))
    except SshError as exc:
        _err(str(exc))
        return EXIT_USAGE
    if rc != EXIT_OK or layout is None:
        return rc or EXIT_USAGE
    print(
        f"aerie: run started on {plan.executor.host}:{layout.root}; re-attach from anywhere with "
        f"`aerie attach {plan.path}`",
        file=sys.stderr,
    )
    return SshTransport(HostConnection(SshTarget.from_executor(plan.executor, plan.path)), layout)


async def _layout_of(target: SshTarget, remote_dir: str) -> RemoteLayout:
    """The run's layout as the ssh bootstrap recorded it, else found on the host (a run started there with
    ``aerie run`` or ``aerie demo``: :mod:`console.ssh.adopt`)."""
    async with HostConnection(target) as conn:
        try:
            return await load_layout(conn, remote_dir)
        except LayoutMissing:
            return await adopt_layout(conn, remote_dir)


def attach_transport(arg: str) -> Transport | int:
    """The transport for ``aerie attach ssh://host/path`` or ``aerie attach PLAN`` (either executor)."""
    try:
        if arg.startswith("ssh://"):
            target, remote_dir = parse_ssh_url(arg)
        else:
            plan = _load_ssh_plan(arg)
            if isinstance(plan, int):
                return plan
            if not plan.executor.host:  # local, or slurm from this login node
                if not (plan.run_dir / "plan.toml").is_file():
                    _err(f"{plan.run_dir}: no such run (start it with `aerie run {arg}`)")
                    return EXIT_USAGE
                return LocalTransport(str(plan.run_dir))
            target, remote_dir = (
                SshTarget.from_executor(plan.executor, plan.path),
                str(plan.executor.remote_dir),
            )
        layout = asyncio.run(_layout_of(target, remote_dir))
    except SshError as exc:
        _err(str(exc))
        return EXIT_USAGE
    return SshTransport(HostConnection(target), layout)


async def _ctl(transport: Transport, *argv: str) -> CtlResult:
    try:
        return await transport.ctl(*argv)
    finally:
        await transport.close()


def remote_ctl(arg: str, *argv: str) -> CtlResult | int:
    """Run one ``pipeline.run.supervise.ctl`` action on the run's host (``aerie kill ssh://host/run STAGE``)."""
    t = attach_transport(arg)
    if isinstance(t, int):
        return t
    return asyncio.run(_ctl(t, *argv))


def remote_state(arg: str) -> dict | int:
    """The supervisor's ``state.json`` of a remote run (for ``aerie status``)."""
    res = remote_ctl(arg, "status")
    if isinstance(res, int):
        return res
    if res.returncode != 0:
        _err(res.message or f"status failed (exit {res.returncode})")
        return res.returncode
    try:
        return json.loads(res.stdout)
    except ValueError:
        _err(f"{arg}: unreadable status from the host: {res.stdout[:200]!r}")
        return EXIT_USAGE
