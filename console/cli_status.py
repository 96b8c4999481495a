"""``aerie status``: every stage's row (its display state, as the board shows it: a queued job is
``starting``), the supervisor's liveness and alerts, then the run's projection, the
run's alert records (raised on the executing host, :mod:`pipeline.run.alerts`; open ones first, with their
evidence and hook deliveries), then the audit log's last entries (``--json``: a line per stage — its whole row,
every field of the typed snapshot's rows — then ``{"projection": …, "supervisor": …}``, ``{"alerts": […]}``,
``{"anomalies": […]}`` (the open anomaly records), ``{"audit": …}``), made by ``ctl status`` on the executing
host, locally or over SSH. A truncated or corrupt ``state.json`` is one warning line naming it
(``--json``: a first line ``{"error": …}``) above the stages as their own files show them, never a traceback.

The supervisor line is the host's verdict (:mod:`pipeline.run.supervise.liveness`, judged by the run's lock and the
snapshot's age): running, silent (alive but not writing, and why) or dead (and when it was last seen); its alerts
(a write that fails, a damaged stage file) follow, open ones first."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from console.cli_common import open_run, remote, run_ctl
from pipeline.run.alerts.record import ANOMALY_KINDS, AlertRecord
from pipeline.run.alerts.record import status_lines as alert_lines
from pipeline.run.projection.compute import RunProjection
from pipeline.run.projection.text import status_lines
from pipeline.run.rundir import audit
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.stage_row import StageRow
from pipeline.run.rundir.state_file import SnapshotRow, StateSnapshot, read_state

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
    stages = [st for st in state.get("stages", []) if isinstance(st, dict)]
    projection = state.get("projection")
    problem = state.get(
        "error"
    )  # state.json unreadable: one line naming it (pipeline/run/rundir/state_file.py)
    if isinstance(problem, str):
        if args.json:
            print(json.dumps({"error": problem}))  # the first line, before the stages
        else:
            print(f"aerie: warning: {problem}", file=sys.stderr)
    alerts = _alerts(state)
    if args.json:
        for row in snapshot_rows(stages):
            print(json.dumps(row.to_dict()))  # every row field (StageRow), its display state and progress
        run_line: dict[str, Any] = {"projection": projection} if isinstance(projection, dict) else {}
        sup = supervisor_section(state)
        if sup is not None:
            run_line["supervisor"] = sup
        if run_line:
            print(json.dumps(run_line))  # after the stages: the run as a whole
        _print_alerts_json(alerts)
        _print_audit(state.get("audit"), as_json=True)
        return EXIT_OK
    for sr in snapshot_rows(stages):  # each stage as the board shows it: its display state (queued: starting)
        st, prog = sr.row, sr.progress or {}
        p = f"{prog.get('done')}/{prog.get('total')} {prog.get('unit') or ''}" if prog else ""
        print(
            f"{st.id:<30} {st.display_state!s:<16} try {st.attempt!s:<3} {p:<24} "
            f"{_forced_mark(st)}{st.reason or ''}".rstrip()
        )
    sup_lines = supervisor_lines(state)
    if sup_lines:  # its own block: the stage table above stays a table
        print()
        print("\n".join(sup_lines))
    if isinstance(projection, dict):
        print()
        print("\n".join(projection_report(projection)))
    if alerts is not None:
        print()
        print("\n".join(alert_section(alerts)))
    _print_audit(state.get("audit"))
    return EXIT_OK


def _forced_mark(row: StageRow) -> str:
    """``aerie force`` armed on a stage not started yet: said before its reason, with how to disarm it."""
    if row.force_armed:
        return "⚑ force armed (aerie force --cancel RUN STAGE disarms it) · "
    return ""


def snapshot_rows(stages: list[dict]) -> list[SnapshotRow]:
    """The stage rows as the typed snapshot decodes them (:class:`StateSnapshot`): each with every field of
    :class:`~pipeline.run.rundir.stage_row.StageRow` (a field added there is in ``--json`` at once)."""
    return StateSnapshot.from_dict({"stages": [st for st in stages if isinstance(st.get("id"), str)]}).stages


ALERTS_SHOWN = 20  # alert records printed before "… and N more"


def alert_section(alerts: list[AlertRecord]) -> list[str]:
    """The alerts section (open ones first); for a huge run the first few, then how many more (``--json`` has
    them all)."""
    shown = alert_lines(alerts[:ALERTS_SHOWN], time.time())
    if len(alerts) > ALERTS_SHOWN:
        opened = sum(1 for r in alerts if r.open)
        shown[0] = f"alerts: {opened:,} open, {len(alerts) - opened:,} cleared"
        shown.append(f"  … and {len(alerts) - ALERTS_SHOWN:,} more (aerie status --json has them all)")
    return shown


def _hms(t: object) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t))) if isinstance(t, int | float) else "?"


def supervisor_section(state: dict) -> dict | None:
    """``--json``'s ``supervisor``: the host's liveness report and the supervisor's alerts."""
    live = state.get("liveness")
    sup = state.get("supervisor")
    if not isinstance(sup, dict):
        sup = {}
    if not isinstance(live, dict):
        return None
    return {**live, "alerts": [a for a in sup.get("alerts") or [] if isinstance(a, dict)]}


def supervisor_lines(state: dict) -> list[str]:
    """``supervisor: …`` (what is wrong when it is silent or dead), then its alerts: open, then ended."""
    sec = supervisor_section(state)
    if sec is None:
        return []
    text = str(sec.get("text", ""))
    if sec.get("verdict") == "dead":
        text += " — not running: any control action or `aerie attach` starts it"
    out = [text if text.startswith("supervisor") else f"supervisor: {text}"]
    alerts = sorted(sec["alerts"], key=lambda a: (bool(a.get("resolved")), a.get("since") or 0))
    for a in alerts:
        when = f"since {_hms(a.get('since'))}"
        if a.get("resolved"):
            when = f"{_hms(a.get('since'))}–{_hms(a.get('resolved'))}, ended"
        out.append(f"supervisor alert ({when}): {a.get('text', '')}")
    return out


def _print_alerts_json(alerts: list[AlertRecord] | None) -> None:
    """The run's alert records, open first (``{"alerts": …}``); the open anomalies as before."""
    if alerts is not None:
        print(json.dumps({"alerts": [a.to_dict() for a in alerts]}))
        print(json.dumps({"anomalies": [a.to_dict() for a in alerts if a.open and a.kind in ANOMALY_KINDS]}))


def _alerts(state: dict) -> list[AlertRecord] | None:
    """The run's alert records as ``ctl status`` sent them (None: a host whose pipeline predates them)."""
    raw = state.get("alerts")
    if not isinstance(raw, list):
        return None
    out = []
    for d in raw:
        try:
            out.append(AlertRecord.from_dict(d))
        except (TypeError, ValueError, KeyError):
            continue
    return out


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
    return read_state(run)[0]


def projection_report(d: dict) -> list[str]:
    """``aerie status``'s projection lines (``pipeline.run.projection.text``), or why there is none."""
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
