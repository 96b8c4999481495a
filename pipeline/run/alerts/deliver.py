"""Delivers one alert to the plan's hook, on the executing host: ``python -m pipeline.run.alerts.deliver RUN ID
TIMEOUT_S COMMAND`` (started, never waited for, by the supervisor's :class:`~pipeline.run.alerts.hooks.HookSpawner`).

Exactly once per alert, whatever happens to the supervisor: under the alert file's lock it looks at the record,
and goes on only when no delivery was recorded for it yet, writing a ``started`` line in the same locked step.
So a supervisor SIGKILLed after raising an alert, and the one started after it that spawns a deliverer for
every record without a delivery, never run a hook twice. A record whose kind and stage were silenced
(``aerie silence``) gets a ``silenced`` delivery and no hook run. The hook's outcome — exit code, or ``timeout``
when :func:`~pipeline.run.alerts.hooks.run_hook` killed it after ``TIMEOUT_S`` — and its time are appended
last. A hook that fails is recorded, not retried. Stdlib only.
"""

from __future__ import annotations

import sys
import time

from pipeline.run.alerts import record
from pipeline.run.alerts.hooks import hook_env, run_hook
from pipeline.run.alerts.record import AlertRecord, Delivery


def claim(run_root: str, alert_id: int, command: str) -> tuple[AlertRecord | None, bool]:
    """(the record, whether its hook is ours to run): under the file's lock, a ``started`` (or ``silenced``)
    line for a record without any delivery yet."""
    found: list[AlertRecord | None] = [None]
    mine = [False]

    def decide(book: dict[int, AlertRecord]) -> list[dict]:
        rec = book.get(alert_id)
        found[0] = rec
        if rec is None or rec.delivered():
            return []
        silenced = any(r.silenced and r.kind == rec.kind and r.stage == rec.stage for r in book.values())
        status = "silenced" if silenced else "started"
        mine[0] = not silenced
        return [record.hook_line(alert_id, Delivery(status, time.time(), command=command))]

    record.append_if(run_root, decide)
    return found[0], mine[0]


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m pipeline.run.alerts.deliver RUN ID TIMEOUT_S COMMAND", file=sys.stderr)
        return 2
    run_root, alert_id, timeout_s, command = argv[0], int(argv[1]), float(argv[2]), argv[3]
    rec, mine = claim(run_root, alert_id, command)
    if rec is None or not mine:
        return 0
    try:
        res = run_hook(command, hook_env(rec, run_root), timeout_s, cwd=run_root)
        d = Delivery(
            "timeout" if res.rc is None else "done", time.time(), res.rc, res.duration_s, res.output, command
        )
    except OSError as exc:  # /bin/sh missing, no processes left: recorded, not retried
        d = Delivery("failed", time.time(), 127, 0.0, str(exc), command)
    record.append(run_root, [record.hook_line(alert_id, d)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
