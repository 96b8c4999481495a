"""The anomalies going on in a run now, from its files, once: what ``aerie status`` lists under the stages.

The console finds anomalies as it polls (:mod:`console.anomalies`, fed by its :class:`~console.model.RunModel`);
here the same model and the same rules read the run directory once through a transport (local, or SSH for
``ssh://`` runs) — ``state.json``, each stage's events' tail, the telemetry — and report the episodes still
on, with their evidence. The thresholds are the frozen plan's ``[alerts]`` keys over the defaults (a console also
applies the user's config over them, :mod:`console.settings`). No Textual (``tests/test_layout.py``): the CLI
imports it.
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import asdict
from typing import Any

from console.alerts import Alert
from console.anomalies import AnomalyWatcher
from console.model import RunModel
from console.transport import Transport
from pipeline.run.plan.schema import PlanError
from pipeline.run.plan.sections import AlertsSection

POLLS = 3  # state.json; then the events' tails and the telemetry's first line; then the telemetry's tail


async def plan_rules(transport: Transport) -> AlertsSection:
    """The anomaly thresholds for this run: the frozen plan's ``[alerts]`` over the defaults."""
    try:
        res = (await transport.read_many([("plan.toml", 0)], max_bytes=4 << 20))[0]
        raw = tomllib.loads(res.data.decode(errors="replace")) if res.size >= 0 else {}
        section = raw.get("alerts", {})
        return AlertsSection.parse(section if isinstance(section, dict) else {}, "plan.toml")
    except (OSError, tomllib.TOMLDecodeError, PlanError):
        return AlertsSection()  # the defaults: the status still says what they find


async def active_anomalies(transport: Transport, now: float | None = None) -> list[Alert]:
    """The anomaly alerts going on in the run now (stalled, NaN or diverging loss, idle GPUs …)."""
    model = RunModel(transport, backfill=False)
    watcher = AnomalyWatcher(await plan_rules(transport))
    model.listeners.append(watcher.on_event)
    for _ in range(POLLS):
        await model.poll()
    return watcher.active(model, time.time() if now is None else now)


def alert_json(alert: Alert) -> dict[str, Any]:
    """One alert as ``aerie status --json`` prints it."""
    d = asdict(alert)
    d["evidence"] = list(alert.evidence)
    return d


def alert_lines(alerts: list[Alert]) -> list[str]:
    """``aerie status``'s anomaly section: each alert's words, then its evidence indented."""
    if not alerts:
        return ["anomalies: none now"]
    out = [f"anomalies: {len(alerts)} now"]
    for a in alerts:
        out.append(f"  {a.kind:<18} {a.text}")
        out += [f"      {line}" for line in a.evidence]
    return out
