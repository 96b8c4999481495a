"""``aerie status``: every stage's row, then the run's projection, the anomalies going on now with their evidence
(:mod:`console.anomaly_scan`), then the audit log's last entries (``--json``: a line per stage, then
``{"projection": …}``, ``{"anomalies": […]}``, ``{"audit": …}``), made by ``ctl status`` on the executing host,
locally or over SSH (the anomalies: read here, through the console's transport)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from console.alerts import Alert
from console.anomaly_scan import active_anomalies, alert_json, alert_lines
from console.cli_common import open_run, remote, run_ctl
from console.transport import LocalTransport, Transport
from pipeline.run import audit
from pipeline.run.projection import RunProjection
from pipeline.run.projection_text import status_lines
from pipeline.run.rundir import RunDir, read_json

EXIT_OK, EXIT_USAGE = 0, 2


def cmd_status(args: argparse.Namespace) -> int:
    if remote(args.run):
        from console.ssh.commands import remote_state

        state = remote_state(args.run)
        if isinstance(state, int):
            return state
    else:
        run = open_run(args.run)
        if run is None:
            return EXIT_USAGE
        state = _local_state(run)
        if "audit" not in state:  # ctl status could not run: read the log here
            state["audit"] = audit.status_section(run.root)
    stages = state.get("stages", [])
    projection = state.get("projection")
    anomalies = _anomalies(args.run)
    if args.json:
        for st in stages:
            print(
                json.dumps(
                    {
                        **{
                            k: st.get(k)
                            for k in (
                                "id",
                                "state",
                                "attempt",
                                "pid",
                                "pgid",
                                "started_at",
                                "finished_at",
                                "returncode",
                                "reason",
                                "health",
                                "progress",
                            )
                        },
                        **({"job": st["job"]} if st.get("job") else {}),
                    }
                )
            )  # a Slurm stage's job id
        if isinstance(projection, dict):
            print(json.dumps({"projection": projection}))  # after the stages: the run as a whole
        if anomalies is not None:
            print(json.dumps({"anomalies": [alert_json(a) for a in anomalies]}))
        _print_audit(state.get("audit"), as_json=True)
        return EXIT_OK
    for st in stages:
        prog = st.get("progress") or {}
        p = f"{prog.get('done')}/{prog.get('total')} {prog.get('unit') or ''}" if prog else ""
        print(
            f"{st['id']:<30} {st['state']:<16} try {st['attempt']:<3} {p:<24} {st.get('reason') or ''}".rstrip()
        )
    if isinstance(projection, dict):
        print()
        print("\n".join(projection_report(projection)))
    if anomalies is not None:
        print()
        print("\n".join(alert_lines(anomalies)))
    _print_audit(state.get("audit"))
    return EXIT_OK


def _anomalies(arg: str) -> list[Alert] | None:
    """The anomalies going on in the run now (None, with a warning, when its files cannot be read)."""
    if remote(arg):
        from console.ssh.commands import attach_transport

        t = attach_transport(arg)
        if isinstance(t, int):
            return None
        transport: Transport = t
    else:
        run = open_run(arg)
        if run is None:
            return None
        transport = LocalTransport(str(run.root))

    async def scan() -> list[Alert]:
        try:
            return await active_anomalies(transport)
        finally:
            await transport.close()

    try:
        return asyncio.run(scan())
    except Exception as exc:  # noqa: BLE001 - the stages' rows are printed anyway
        print(f"aerie: warning: anomalies not checked: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _local_state(run: RunDir) -> dict:
    """``state.json`` with the run's projection, as ``ctl status`` makes them on the host (as over SSH);
    ``state.json`` alone if that fails."""
    rc, out, _err = run_ctl(run, "status")
    if rc == 0:
        try:
            state = json.loads(out)
            if isinstance(state, dict):
                return state
        except ValueError:
            pass
    return read_json(run.state_path) or {"stages": []}


def projection_report(d: dict) -> list[str]:
    """``aerie status``'s projection lines (``pipeline.run.projection_text``), or why there is none."""
    if "error" in d:
        return [f"projection: none ({d['error']})"]
    try:
        return status_lines(RunProjection.from_dict(d))
    except (TypeError, ValueError, KeyError) as exc:  # a host with another Aerie version
        return [f"projection: unreadable ({type(exc).__name__}: {exc})"]


def _print_audit(section: dict | None, as_json: bool = False) -> None:
    """The audit log's last entries after the stages (``--json``: a last line ``{"audit": …}``); a host
    whose pipeline predates the audit log sends no section."""
    if section is not None:
        lines = [json.dumps({"audit": section})] if as_json else audit.section_lines(section)
        if lines:
            print("\n".join(lines))
        for problem in section.get("problems", []):
            print(f"aerie: warning: {problem}", file=sys.stderr)
