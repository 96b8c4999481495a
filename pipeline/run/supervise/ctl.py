"""Control entry point on the executing host: ``python -m pipeline.run.supervise.ctl RUN ACTION [STAGE]``.

The console and the ``aerie`` CLI never signal processes themselves: they run this (as a local
subprocess, or through the SSH connection on the container). It validates the stage id, queues a
request in the run dir, makes sure a supervisor is running, and waits for the supervisor's answer.

Actions: ``status`` (prints state.json, with the run's ``projection``: :mod:`pipeline.run.supervise.run_projection`,
the audit log's last entries and the supervisor's ``liveness``: :mod:`pipeline.run.supervise.liveness`; a corrupt
state.json gives rows from the stages' own files and an ``error`` line, :mod:`pipeline.run.rundir.state_file`; so
does a run with no snapshot yet, without the line),
``liveness`` (that report alone, as JSON; starts nothing: what a read-only watcher asks), ``ensure`` (start a
supervisor if none holds the lock; one line, or with ``--json`` the liveness report and ``started``),
``pause``, ``resume``, ``kill``, ``retry [--fresh]``, ``skip``, ``force`` (start past the
admission checks: disk budget, GPU guard; recorded in the stage's events), ``force --cancel`` (disarm an armed
``force`` before the stage starts; queued and audited as ``unforce``), ``ack ALERT_ID`` and ``silence
ALERT_ID`` (acknowledge an alert of ``RUN/alerts.jsonl``; silence also keeps the hook from running for later
alerts of the same kind on the same stage: :mod:`pipeline.run.alerts.record`, :func:`acknowledge`), written here
under the alert file's lock — the supervisor is not needed for them.

Every control action is recorded in ``RUN/audit.jsonl`` (:mod:`pipeline.run.rundir.audit`): the front end
says which it is (``--via console|cli|browser``) and who its operator is (``--who user@host``, default
the account running this); the supervisor records the outcome when it acts, this records a request
refused before it was queued and one that timed out.

Exit codes: 0 done; 2 usage error, unknown run or unknown stage; 3 refused by the supervisor
(e.g. pausing a stage that is not running); 4 no answer from the supervisor in time; 5 the run directory
could not be read or written here (e.g. it is read-only: the request was not queued). Every error is one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.run.alerts import record as alert_record
from pipeline.run.alerts.record import AlertRecord
from pipeline.run.rundir import audit
from pipeline.run.rundir.layout import RunDir, read_json
from pipeline.run.rundir.state_file import read_state, rows_from_files
from pipeline.run.supervise.liveness import liveness
from pipeline.run.supervise.run_projection import run_projection
from pipeline.run.supervise.run_setup import spawn_detached, supervisor_alive

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_TIMEOUT, EXIT_HOST = 0, 2, 3, 4, 5
ACTIONS = (
    "status",
    "liveness",
    "ensure",
    "pause",
    "resume",
    "kill",
    "retry",
    "skip",
    "force",
    "unforce",
    "ack",
    "silence",
)
ALERT_ACTIONS = ("ack", "silence")  # on an alert record (its id in place of the stage)


def ensure_supervisor(run: RunDir) -> bool:
    """Start a supervisor unless one runs; returns True when one was started."""
    if supervisor_alive(run):
        return False
    spawn_detached(run.root)
    return True


def ensure_report(run: RunDir) -> dict[str, Any]:
    """``ensure``: the liveness report before, and whether a supervisor was started (the dead one's
    successor; a silent one holds its lock, so none is started beside it)."""
    rep = liveness(run, read_state(run)[0])
    rep["started"] = ensure_supervisor(run) if rep["verdict"] in ("dead", "finished") else False
    if rep["started"]:
        rep["line"] = f"supervisor started; the last one: {rep['text']}"
    elif rep["verdict"] in ("dead", "finished"):  # another came up between the two looks
        rep["line"] = "supervisor already running"
    else:
        rep["line"] = f"supervisor already running ({rep['text']})"
    return rep


RESPAWN_S = 3.0  # while a request waits, how often to check that some supervisor will answer it


def request(
    run: RunDir, action: str, stage: str, timeout_s: float = 15.0, **extra: object
) -> tuple[int, str]:
    """Queue the request and wait for the supervisor's answer. A supervisor of a finished run exits once it
    sees no request; one queued while it was exiting (it still held the lock, so none was started) would wait
    for the next supervisor. So while the request is unanswered, a supervisor is started again every
    ``RESPAWN_S`` when none holds the lock (a second one that finds the lock taken exits at once)."""
    path = run.submit_request(action, stage, **extra)
    ensure_supervisor(run)
    done = run.requests_dir / "done" / path.name
    deadline = time.monotonic() + timeout_s
    recheck = time.monotonic() + RESPAWN_S
    while time.monotonic() < deadline:
        ans = read_json(done)
        if ans is not None:
            return (EXIT_OK if ans.get("ok") else EXIT_REFUSED), str(ans.get("message", ""))
        if time.monotonic() >= recheck:
            if path.exists():  # still queued (a supervisor unlinks it after writing the answer)
                ensure_supervisor(run)
            recheck = time.monotonic() + RESPAWN_S
        time.sleep(0.05)
    live = liveness(run, read_state(run)[0])
    return (
        EXIT_TIMEOUT,
        f"no answer from the supervisor of {run.root} within {timeout_s:g}s (request left queued): {live['text']}",
    )


def acknowledge(run: RunDir, action: str, alert_id: str, *, via: str, who: str, account: str) -> int:
    """``ack``/``silence`` an alert: an ``ack`` line in ``alerts.jsonl`` (every front end shows who and when),
    and the audit log's entry. Refused (3) when it was acknowledged before; 2 for an id the run has not."""
    found: list[AlertRecord | None] = [None]

    def decide(book: dict[int, AlertRecord]) -> list[dict[str, Any]]:
        rec = book.get(int(alert_id)) if alert_id.isdigit() else None
        found[0] = rec
        if rec is None or (rec.acked_at is not None and (rec.silenced or action == "ack")):
            return []
        return [alert_record.ack_line(rec.id, who, time.time(), silence=action == "silence")]

    alert_record.append_if(run.root, decide)
    rec = found[0]
    if rec is None:
        msg = f"{run.root}: no alert {alert_id!r} (aerie status lists the run's alerts)"
        audit.append(run.root, audit.entry(action, "", "refused", msg, via=via, who=who, account=account))
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    what = f"alert #{rec.id} ({rec.kind}{' on ' + rec.stage if rec.stage else ''})"
    if rec.acked_at is not None and (rec.silenced or action == "ack"):
        msg = f"{what} was acknowledged by {rec.acked_by} before"
        audit.append(
            run.root, audit.entry(action, rec.stage, "refused", msg, via=via, who=who, account=account)
        )
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_REFUSED
    msg = f"{what} acknowledged" + (
        f"; its hook stays quiet for {rec.kind} on {rec.stage or 'the run'}" if action == "silence" else ""
    )
    audit.append(run.root, audit.entry(action, rec.stage, "done", msg, via=via, who=who, account=account))
    print(msg)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader went away (`… status | head -1`): quiet, as SIGPIPE would be
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the run dir cannot be written or read here: one line, never a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: cannot use the run directory: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_HOST
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a damaged run file
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_HOST


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run.supervise.ctl")
    ap.add_argument("run", type=Path)
    ap.add_argument("action", choices=ACTIONS)
    ap.add_argument("stage", nargs="?")
    ap.add_argument("--fresh", action="store_true", help="retry: clear the stage's outputs first")
    ap.add_argument("--cancel", action="store_true", help="force: disarm an armed force (action unforce)")
    ap.add_argument("--timeout", type=float, default=15.0)
    ap.add_argument("--json", action="store_true", help="ensure: print the liveness report as JSON")
    ap.add_argument(
        "--via",
        choices=audit.FRONT_ENDS,
        default="ctl",
        help="the front end that sent the action (audit log)",
    )
    ap.add_argument(
        "--who", default=None, help="the operator, user@host where the front end runs (audit log)"
    )
    args = ap.parse_args(argv)
    run = RunDir(args.run)
    if not run.exists():
        print(f"error: {run.root}: no such run (no plan.toml / stages/ there)", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "status":
        state, problem = read_state(run)  # a corrupt state.json: rows from the stages' files and an "error"
        if not state.get("stages") and not problem:  # no snapshot yet (no supervisor ever wrote one)
            state["stages"] = rows_from_files(run)  # every stage as its own files show it
        state["liveness"] = liveness(run, state)
        state["supervisor_alive"] = state["liveness"]["lock_held"]
        state["projection"] = (
            {"error": "state.json unreadable"} if problem else run_projection(run, state, time.time())
        )
        state["audit"] = audit.status_section(run.root)
        state["alerts"] = alert_record.status_section(run.root)  # the run's alert records, open first
        print(json.dumps(state))
        return EXIT_OK
    if args.action == "liveness":
        print(json.dumps(liveness(run, read_state(run)[0])))
        return EXIT_OK
    if args.action == "ensure":
        rep = ensure_report(run)
        print(json.dumps(rep) if args.json else rep["line"])
        return EXIT_OK
    if not args.stage:
        print(
            f"error: {args.action} needs a {'alert' if args.action in ALERT_ACTIONS else 'stage'} id",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.action == "force" and args.cancel:
        args.action = "unforce"  # ``force --cancel``: its own action in the requests and the audit log
    who, account = (args.who or audit.identity())[:200], audit.identity()
    if args.action in ALERT_ACTIONS:
        return acknowledge(run, args.action, args.stage, via=args.via, who=who, account=account)
    fresh = bool(args.fresh and args.action == "retry")

    def record(outcome: str, message: str) -> None:
        audit.append(
            run.root,
            audit.entry(
                args.action, args.stage, outcome, message, via=args.via, who=who, account=account, fresh=fresh
            ),
        )

    if args.stage not in run.stage_ids():
        msg = f"{run.root}: unknown stage {args.stage!r} (stages: {', '.join(run.stage_ids())})"
        record("refused", f"unknown stage {args.stage!r}")
        print(f"error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    extra: dict[str, object] = {"via": args.via, "who": who, "account": account}
    if fresh:
        extra["fresh"] = True
    code, msg = request(run, args.action, args.stage, timeout_s=args.timeout, **extra)
    if code == EXIT_TIMEOUT:
        record("timed out", msg)
    print(msg if code == EXIT_OK else f"error: {msg}", file=sys.stdout if code == EXIT_OK else sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
