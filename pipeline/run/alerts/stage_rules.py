"""The rules of a stage's state and clock: failed, stalled, forced start, idle GPUs, the disk and the
train-versus-serve gap — each given what the watcher (:mod:`pipeline.run.alerts.watcher`) keeps of a stage.

* **stage-failed**: a stage whose current attempt failed (one episode per attempt; cleared by a retry).
* **stalled** (``stall_minutes``): a running stage with no progress event and no metric for that long.
  Service stages (a server answers requests, it reports no progress), paused, pausing and queued stages
  are left out, and so is an operator command until it has reported something once.
* **forced-start**: a stage started with ``aerie force`` (the supervisor's ``forced`` message): its disk-budget
  and GPU-guard checks were skipped — said when it happens, which may be long after the force was armed.
* **gpu-idle** (``gpu_idle_minutes``, ``gpu_idle_util``): a GPU allocated to a running non-service stage
  at or below ``gpu_idle_util`` % for that long, by the telemetry samples' own clock (local and SSH executors: the supervisor's own host).
* **disk** : the telemetry agent's disk record says the outputs still to write do not fit (``warning``) or
  the free space is below the plan's reserve (``error``); re-armed once it fits again.
* **accept-gap** (``accept_gap``): the bench stage's served accept length below the train stage's simulated
  one for the same draft by more than that fraction (:func:`accept_gap`), read from the bench stage's message
  coded ``accept-gap`` that carries both numbers and where each came from (``pipeline/stages/bench/gap.py``).

Pure: the caller reads the files; these look at what it read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.run.alerts.record import Alert
from pipeline.run.alerts.rules import ACCEPT, LOSS, RUNNING_REQ, THROUGHPUT, AcceptRule, LossRule, ServerRule
from pipeline.run.plan.sections import AlertsSection
from pipeline.run.projection.text import duration, size
from pipeline.run.rundir.protocol import FORCED as FORCED_CODE
from pipeline.run.rundir.protocol import Health, Message, Metric, RunEvent
from pipeline.run.rundir.stage_reducer import StageFacts
from pipeline.run.rundir.stage_row import StageRow, StageState

FORCED = "forced-start"
FROM_EVENTS = frozenset(
    {"loss-nonfinite", "loss-diverging", "accept-falling", "server-throughput", "server-unhealthy"}
    | {"stalled", "gpu-idle", FORCED}
)
GAP_CODE = (
    "accept-gap"  # the bench stage's message (pipeline/stages/bench/gap.py; a stage is not imported here)
)


def _num(v: float) -> str:
    return f"{v:.4g}"


@dataclass
class StageWatch:
    """What the rules keep about one attempt of one stage."""

    attempt: int
    facts: StageFacts = field(default_factory=StageFacts)  # the run's reducer over this attempt's events
    metric: tuple[float, str, float] | None = None  # (t, name, value) of the latest metric
    loss: LossRule = field(default_factory=LossRule)
    accept: AcceptRule = field(default_factory=AcceptRule)
    server: ServerRule = field(default_factory=ServerRule)
    resumed_at: float | None = None  # when the watcher saw it resume from a pause (its clock restarts)
    was_paused: bool = False
    stall_key: str | None = None
    idle_key: str | None = None
    forced: list[Alert] = field(default_factory=list)


def on_event(sw: StageWatch, ev: RunEvent, rules: AlertsSection, sid: str, service: bool) -> Alert | None:
    """One typed event of the stage's current attempt (:mod:`pipeline.run.rundir.protocol`, already folded into
    ``sw.facts`` by the run's reducer): what it tells the rules (an episode found, or None)."""
    match ev:
        case Message(code=code) if code == FORCED_CODE:
            return forced_alert(sid, sw.attempt, ev)
        case Message(code=code) if code == GAP_CODE:  # the bench stage's served-vs-simulated record
            return accept_gap(sid, sw.attempt, dict(ev.data), rules)
        case Health() if service:
            return sw.server.health(ev, sid, sw.attempt)
        case Metric():
            return _metric(sw, ev, rules, sid)
    return None


def _metric(sw: StageWatch, ev: Metric, rules: AlertsSection, sid: str) -> Alert | None:
    raw = ev.data.get("value")
    if not isinstance(raw, int | float) or isinstance(raw, bool):
        return None  # not a number at all (the decoder made it NaN): no rule's business
    sw.metric = (ev.t, ev.name, ev.value)
    if ev.name == LOSS:
        sw.accept.feed_loss(ev.value)
        return sw.loss.feed(ev.value, ev, rules, sid, sw.attempt)
    if ev.name == ACCEPT:
        return sw.accept.feed(ev.value, ev, rules, sid, sw.attempt)
    if ev.name == RUNNING_REQ:
        sw.server.running = ev.value
    elif ev.name == THROUGHPUT and ev.data.get("batch", "decode") == "decode":
        return sw.server.feed(ev.value, ev, rules, sid, sw.attempt)
    return None


def still_on(sw: StageWatch | None, kind: str, row: StageRow | None) -> bool:
    """Whether an open episode of ``kind`` on this stage goes on (False: clear it). ``sw`` None: the watcher
    follows none of its events (a restarted supervisor, the stage ended): only what needs no events is known."""
    if row is None:
        return False
    if kind == "stage-failed":
        return row.state == StageState.FAILED and (sw is None or row.attempt == sw.attempt)
    if sw is None:  # the flags below come from events; an ended stage's episodes of them have ended
        return kind not in FROM_EVENTS or kind == GAP_CODE
    flags = {
        "loss-nonfinite": sw.loss.nonfinite,
        "loss-diverging": sw.loss.diverging,
        "accept-falling": sw.accept.falling,
        "server-throughput": sw.server.collapsed,
        "server-unhealthy": sw.server.unhealthy,
        "stalled": sw.stall_key is not None,
        "gpu-idle": sw.idle_key is not None,
    }
    if kind in flags:
        return flags[kind] and row.state in (StageState.RUNNING, StageState.PAUSED)
    if kind == FORCED:
        return row.state in (StageState.RUNNING, StageState.PAUSED)
    return True


def failed(row: StageRow) -> Alert | None:
    """The stage's current attempt failed."""
    if row.state != StageState.FAILED:
        return None
    why = row.reason or (f"exit {row.returncode}" if row.returncode is not None else "failed")
    evidence = [f"exit code {row.returncode}" if row.returncode is not None else "no exit code (lost)"]
    if row.retry_at is not None:
        evidence.append("an automatic retry is scheduled")
    return Alert(
        f"stage-failed:{row.id}:{row.attempt}",
        "stage-failed",
        f"{row.id} failed",
        f"{row.id} attempt {row.attempt} failed: {why}",
        row.id,
        row.attempt,
        tuple(evidence),
    )


def forced_alert(sid: str, attempt: int, ev: Message) -> Alert:
    """A stage started with ``--force`` (``Supervisor.launch``'s ``forced`` message)."""
    raw = ev.data.get("attempt")
    n = raw if isinstance(raw, int) and not isinstance(raw, bool) else attempt
    return Alert(
        f"{FORCED}:{sid}:{n}",
        FORCED,
        f"{sid} started with --force",
        f"{sid} attempt {n} started without the disk-budget and GPU-guard checks (aerie force)",
        sid,
        n,
        (ev.text,),
    )


def stall(
    row: StageRow, sw: StageWatch, rules: AlertsSection, now: float, last_log: Callable[[], str]
) -> Alert | None:
    """A running stage silent (no progress, no metric) for ``stall_minutes``."""
    if rules.stall_minutes <= 0 or row.service:
        return None
    metric_t = sw.facts.metric_t  # the run's reducer: when the latest metric came
    p = sw.facts.progress
    progress_t = p.t if p else 0.0
    if row.run is None and not (progress_t or metric_t):
        return None  # an operator command that never reports: silence is its normal
    last = max(row.started_at or 0.0, progress_t, metric_t, sw.resumed_at or 0.0)
    if not last or now - last < rules.stall_minutes * 60:
        sw.stall_key = None
        return None
    key = f"stalled:{row.id}:{sw.attempt}:t{int(last)}"
    if key == sw.stall_key:
        return None
    sw.stall_key = key
    evidence = [f"rule: no progress and no metric for {rules.stall_minutes:g} min"]
    if p:
        tot = f"/{p.total:g}" if p.total else ""
        evidence.append(f"last progress {p.done:g}{tot} {p.unit} {duration(now - p.t)} ago")
    else:
        evidence.append("no progress reported in this attempt")
    if sw.metric:
        t, name, value = sw.metric
        evidence.append(f"last metric {name} = {_num(value)} {duration(now - t)} ago")
    line = last_log()
    if line:
        evidence.append(f"last log line: {line[:200]}")
    return Alert(
        key,
        "stalled",
        f"{row.id}: no progress for {duration(now - last)}",
        f"{row.id} attempt {sw.attempt} is running but has reported nothing for {duration(now - last)}",
        row.id,
        sw.attempt,
        tuple(evidence),
    )


@dataclass
class GpuSeen:
    """One GPU as the telemetry agent last sampled it, and since when it has been idle."""

    t: float = 0.0
    util: float | None = None
    mem_used: float | None = None
    owners: tuple[str, ...] = ()
    idle_since: float | None = None

    def apply(self, r: dict[str, Any], idle_util: float) -> None:
        self.t = float(r.get("t") or 0.0)
        u = r.get("util")
        self.util = float(u) if isinstance(u, int | float) and not isinstance(u, bool) else None
        m = r.get("mem_used")
        self.mem_used = float(m) if isinstance(m, int | float) and not isinstance(m, bool) else None
        raw = r.get("procs")
        procs: list[Any] = raw if isinstance(raw, list) else []
        self.owners = tuple(
            sorted({str(p.get("owner")) for p in procs if isinstance(p, dict) and p.get("owner")})
        )
        if self.util is None:
            return
        if self.util > idle_util:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = self.t


def gpu_idle(row: StageRow, sw: StageWatch, gpus: dict[int, GpuSeen], rules: AlertsSection) -> Alert | None:
    """GPUs allocated to a running stage that sit idle for ``gpu_idle_minutes`` (samples' own clock)."""
    if rules.gpu_idle_minutes <= 0 or row.service or not row.gpus:
        return None
    start = row.started_at or 0.0
    long = {
        i: g.t - max(g.idle_since, start)
        for i in row.gpus
        if (g := gpus.get(i)) is not None
        and g.idle_since is not None
        and g.t - max(g.idle_since, start) >= rules.gpu_idle_minutes * 60
    }
    if not long:
        sw.idle_key = None
        return None
    since = min(max(gpus[i].idle_since or 0.0, start) for i in long)
    key = f"gpu-idle:{row.id}:{sw.attempt}:t{int(since)}"
    if key == sw.idle_key:
        return None
    sw.idle_key = key
    ids = ", ".join(str(i) for i in sorted(long))
    return Alert(
        key,
        "gpu-idle",
        f"{row.id}: GPU {ids} idle",
        f"{row.id} attempt {sw.attempt} holds GPU {ids}, idle for {duration(max(long.values()))}",
        row.id,
        sw.attempt,
        tuple(
            f"GPU {i}: utilisation {gpus[i].util:g}% for {duration(d)}, memory "
            f"{size(gpus[i].mem_used or 0)}, processes: {', '.join(gpus[i].owners) or 'none'}"
            for i, d in sorted(long.items())
        )
        + (f"rule: at or below {rules.gpu_idle_util:g}% for {rules.gpu_idle_minutes:g} min",),
    )


def disk_level(r: dict[str, Any]) -> str:
    """The level of one telemetry ``disk`` record: ``ok``, ``warning`` (the outputs still to write do not
    fit) or ``error`` (free space below the plan's reserve). Cheap: one per sample."""
    avail, reserve, need = r.get("avail"), r.get("reserve") or 0, r.get("projected_remaining")
    if not isinstance(avail, int | float) or not isinstance(reserve, int | float):
        return "ok"
    room = avail - reserve
    if room <= 0:
        return "error"
    if isinstance(need, int | float) and need > room:
        return "warning"
    return "ok"


def disk_words(r: dict[str, Any]) -> str:
    """What a disk alert says of the record that raised it."""
    avail, reserve, need = r.get("avail") or 0, r.get("reserve") or 0, r.get("projected_remaining")
    words = f"{r.get('mount') or r.get('path') or 'disk'}: {size(avail)} free (reserve {size(reserve)})"
    if avail - reserve <= 0:
        return words + ": below the reserve"
    if isinstance(need, int | float):
        return words + f": {size(need)} still to write, {size(need - (avail - reserve))} short"
    return words


def disk_alert(level: str, words: str, t: float) -> Alert:
    title = "disk below the reserve" if level == "error" else "disk projection does not fit"
    return Alert(f"disk:{level}:t{int(t)}", "disk", title, words, "", 0, (words,))


def accept_gap(sid: str, attempt: int, bench: dict[str, Any], rules: AlertsSection) -> Alert | None:
    """The bench stage's ``accept_gap`` record (served vs the train stage's simulated accept length for the
    same draft): an alert when the served one is lower by more than ``accept_gap`` (relative)."""
    sim, served = bench.get("simulated"), bench.get("served")
    if rules.accept_gap <= 0 or not isinstance(sim, int | float) or not isinstance(served, int | float):
        return None
    if not (math.isfinite(sim) and math.isfinite(served)) or sim <= 0:
        return None
    gap = (sim - served) / sim
    if gap <= rules.accept_gap:
        return None
    how = str(bench.get("how") or "served")  # served by an engine, or measured offline by the bench stage
    return Alert(
        f"accept-gap:{sid}:{attempt}",
        "accept-gap",
        f"{sid}: {how} accept length {_num(served)} vs {_num(sim)} in training",
        f"{sid}: the {how} accept length {_num(served)} is {gap * 100:.1f}% below the train stage's simulated "
        f"{_num(sim)} for the same draft (threshold {rules.accept_gap * 100:g}%)",
        sid,
        attempt,
        (
            f"{how} {_num(served)}: {bench.get('served_from', '?')}",
            f"simulated {_num(sim)}: {bench.get('simulated_from', '?')}",
            f"rule: {how} below simulated by more than {rules.accept_gap * 100:g}%",
        ),
    )
