"""Anomalies: a stage that is alive but wrong, found in what the console's model already reads.

Over 450 lines because it is one rule table: the rules share the episode bookkeeping (fire once, re-arm),
the thresholds and the evidence format, and ``aerie status`` runs the same table (:mod:`console.anomaly_scan`).

One small rule per anomaly; each fires once per episode with its evidence and re-arms when its
condition clears (``docs/operating.md``, "On day four", says what each means and what to do). The
thresholds are the plan's ``[alerts]`` keys (:class:`~pipeline.run.plan.sections.AlertsSection`):

* **stalled** (``stall_minutes``): a running stage with no progress event and no metric for that long.
  Service stages (a server answers requests, it reports no progress), paused, pausing and queued stages
  are left out, and so is an operator command until it has reported something once.
* **loss-nonfinite**: a ``loss`` metric that is NaN or ±inf.
* **loss-diverging** (``diverge_factor``, ``diverge_window``): the loss above ``diverge_factor`` times
  its minimum over the previous ``diverge_window`` logged points, :data:`CONFIRM` points in a row, once
  at least :data:`MIN_POINTS` points are known.
* **accept-falling** (``accept_window``, ``accept_drop``): over the last ``accept_window`` evaluations
  the train stage's ``accept_length`` never rose and fell by ``accept_drop`` (relative) or more, while
  the ``loss`` at those evaluations fell — the draft is learning the data, not the target's choices.
* **gpu-idle** (``gpu_idle_minutes``, ``gpu_idle_util``): a GPU allocated to a running non-service stage
  at or below ``gpu_idle_util`` % for that long, by the telemetry samples' own clock (local executor).
* **server-throughput** (``throughput_fraction``, ``throughput_window``): the server's decode
  ``gen_throughput`` below that fraction of its median over the last ``throughput_window`` samples,
  :data:`CONFIRM` samples in a row, while requests run (at least half as many as the median, so a
  lighter load is not a collapse). **server-unhealthy**: a running server whose health turned unhealthy.
* **forced-start**: a stage started with ``aerie force`` (the supervisor's ``forced`` message): its disk-budget
  and GPU-guard checks were skipped — said when it happens, which may be long after the force was armed.

Cheap and incremental, because the console polls: the model hands each event it applies to
:meth:`AnomalyWatcher.on_event` (constant work per event; a median of at most ``throughput_window``
numbers per throughput sample), and :meth:`AnomalyWatcher.check` after a poll looks at each running
stage's clock and its GPUs' latest readings. An alert's key names its episode by data every console
reads alike (the step, or the time it began), so :class:`~console.alerts.AlertBook` announces it once
across consoles. Pure: no files, no processes, no Textual.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from console import executors, fmt
from console.alerts import Alert
from console.model import RunModel, StageView
from console.telemetry_model import TelemetryModel
from pipeline.run.plan.sections import AlertsSection
from pipeline.run.rundir.events import Event
from pipeline.run.rundir.stage_row import HealthState, StageState

# The train stage's metric names (pipeline/stages/train), the serve stage's (pipeline/serving/sglang_log.py).
LOSS, ACCEPT = "loss", "accept_length"
THROUGHPUT, RUNNING_REQ = "gen_throughput", "running_req"
CONFIRM = 2  # points in a row a loss or throughput rule must hold: one spike is not a trend
MIN_POINTS = 5  # points a minimum or median needs before it is trusted (fewer where the window is smaller)
MAX_PENDING = 100


def _num(v: float) -> str:
    return f"{v:.4g}"


def _at(ev: Event) -> tuple[str, str]:
    """(the episode part of a key, the words for where) of a metric event: its step, else its time."""
    step = ev.get("step")
    if isinstance(step, int | float) and not isinstance(step, bool):
        return f"step{int(step)}", f"step {int(step)}"
    return f"t{ev.t:.3f}", time.strftime("%H:%M:%S", time.localtime(ev.t))


class LossRule:
    """NaN/inf loss, and divergence from the loss's recent minimum."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, str]] = deque(maxlen=AlertsSection.diverge_window)
        self.over: deque[tuple[float, str, str]] = deque(maxlen=CONFIRM)
        self.nonfinite = False  # in a NaN episode (re-armed by the next finite loss)
        self.diverging = False  # in a divergence episode (re-armed once the loss is back under the line)

    def feed(self, value: float, ev: Event, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
        key_at, where = _at(ev)
        if not math.isfinite(value):
            if self.nonfinite:
                return None
            self.nonfinite = True
            last = ", ".join(f"{_num(v)} ({w})" for v, w in list(self.recent)[-3:])
            return Alert(
                f"loss-nonfinite:{sid}:{attempt}:{key_at}",
                "loss-nonfinite",
                f"{sid}: loss is {value}",
                f"{sid} attempt {attempt}: the loss became {value} at {where}",
                sid,
                attempt,
                (f"loss = {value} at {where}", f"last finite losses: {last or 'none in this attempt'}"),
            )
        self.nonfinite = False
        if self.recent.maxlen != rules.diverge_window:
            self.recent = deque(self.recent, maxlen=rules.diverge_window)
        alert = self._diverge(value, key_at, where, rules, sid, attempt)
        self.recent.append((value, where))
        return alert

    def _diverge(
        self, value: float, key_at: str, where: str, rules: AlertsSection, sid: str, attempt: int
    ) -> Alert | None:
        k = rules.diverge_factor
        if k <= 0 or len(self.recent) < min(MIN_POINTS, rules.diverge_window):
            return None
        low, low_at = min(self.recent)
        if low <= 0 or value <= k * low:
            self.over.clear()
            self.diverging = False
            return None
        self.over.append((value, where, key_at))
        if len(self.over) < CONFIRM or self.diverging:
            return None
        self.diverging = True
        seen = ", ".join(f"{_num(v)} at {w}" for v, w, _ in self.over)
        return Alert(
            f"loss-diverging:{sid}:{attempt}:{self.over[0][2]}",
            "loss-diverging",
            f"{sid}: loss diverging",
            f"{sid} attempt {attempt}: loss {_num(value)} at {where} is over {k:g} × its recent minimum "
            f"{_num(low)}",
            sid,
            attempt,
            (
                f"loss {seen}",
                f"minimum of the previous {len(self.recent)} points: {_num(low)} at {low_at}",
                f"rule: loss above {k:g} × {_num(low)} = {_num(k * low)}, {CONFIRM} points in a row",
            ),
        )


class AcceptRule:
    """Acceptance falling across evaluations while the loss falls."""

    def __init__(self) -> None:
        self.loss: float | None = None  # the latest finite loss: the loss at the next evaluation
        self.evals: deque[tuple[float, float | None, str, str]] = deque(maxlen=AlertsSection.accept_window)
        self.falling = False

    def feed_loss(self, value: float) -> None:
        if math.isfinite(value):
            self.loss = value

    def feed(self, value: float, ev: Event, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
        w = rules.accept_window
        if w < 2 or not math.isfinite(value):
            return None
        if self.evals.maxlen != w:
            self.evals = deque(self.evals, maxlen=w)
        key_at, where = _at(ev)
        self.evals.append((value, self.loss, where, key_at))
        if len(self.evals) < w:
            return None
        accs = [e[0] for e in self.evals]
        losses = [e[1] for e in self.evals]
        acc_falls = all(b <= a for a, b in zip(accs, accs[1:], strict=False)) and accs[-1] < accs[0] * (
            1 - rules.accept_drop
        )
        loss_falls = losses[0] is not None and losses[-1] is not None and losses[-1] < losses[0]
        if not (acc_falls and loss_falls):
            self.falling = False
            return None
        if self.falling:
            return None
        self.falling = True
        first = self.evals[0]
        return Alert(
            f"accept-falling:{sid}:{attempt}:{first[3]}",
            "accept-falling",
            f"{sid}: acceptance falling",
            f"{sid} attempt {attempt}: accept length fell {_num(accs[0])} → {_num(accs[-1])} "
            f"({(1 - accs[-1] / accs[0]) * 100:.1f}%) over {w} evaluations while the loss fell",
            sid,
            attempt,
            (
                "accept_length "
                + " → ".join(f"{_num(a)} ({e[2]})" for a, e in zip(accs, self.evals, strict=True)),
                "loss at those evaluations " + " → ".join(_num(x) if x is not None else "?" for x in losses),
            ),
        )


class ServerRule:
    """An inference server's throughput collapsing while requests run, or its health turning unhealthy."""

    def __init__(self) -> None:
        self.running: float | None = None  # the latest running_req
        self.tps: deque[float] = deque(maxlen=AlertsSection.throughput_window)
        self.loads: deque[float] = deque(maxlen=AlertsSection.throughput_window)
        self.low: deque[tuple[float, float, str]] = deque(maxlen=CONFIRM)
        self.collapsed = False
        self.unhealthy = False

    def feed(self, value: float, ev: Event, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
        run, frac = self.running, rules.throughput_fraction
        if frac <= 0 or not run or run < 1 or not math.isfinite(value):
            return None  # no request running: a throughput of 0 means nothing
        if self.tps.maxlen != rules.throughput_window:
            self.tps = deque(self.tps, maxlen=rules.throughput_window)
            self.loads = deque(self.loads, maxlen=rules.throughput_window)
        if len(self.tps) >= min(MIN_POINTS, rules.throughput_window):
            med, med_load = statistics.median(self.tps), statistics.median(self.loads)
            if value < frac * med and run >= 0.5 * med_load:
                self.low.append((value, run, _at(ev)[1]))
                if len(self.low) < CONFIRM or self.collapsed:
                    return None  # a collapsed sample never joins the median it is measured against
                self.collapsed = True
                return Alert(
                    f"server-throughput:{sid}:{attempt}:t{ev.t:.3f}",
                    "server-throughput",
                    f"{sid}: throughput collapsed",
                    f"{sid}: gen throughput {_num(value)} tok/s with {int(run)} requests running, "
                    f"under {frac:g} × its recent median {_num(med)} tok/s",
                    sid,
                    attempt,
                    (
                        "gen_throughput "
                        + ", ".join(f"{_num(v)} tok/s with {int(r)} running at {w}" for v, r, w in self.low),
                        f"median of the last {len(self.tps)} samples: {_num(med)} tok/s "
                        f"with {_num(med_load)} requests running",
                    ),
                )
            if value >= frac * med:
                self.low.clear()
                self.collapsed = False
        self.tps.append(value)
        self.loads.append(run)
        return None

    def health(self, ev: Event, sid: str, attempt: int) -> Alert | None:
        state = str(ev.get("state"))
        if state != HealthState.UNHEALTHY:
            self.unhealthy = False
            return None
        if self.unhealthy:
            return None
        self.unhealthy = True
        detail = str(ev.get("detail") or "failed health probes in a row")
        return Alert(
            f"server-unhealthy:{sid}:{attempt}:t{ev.t:.3f}",
            "server-unhealthy",
            f"{sid}: server unhealthy",
            f"{sid} attempt {attempt}: the server stopped answering its health probe",
            sid,
            attempt,
            (f"health: unhealthy at {time.strftime('%H:%M:%S', time.localtime(ev.t))}: {detail}",),
        )


@dataclass
class StageWatch:
    """What the rules keep about one attempt of one stage."""

    attempt: int
    metric: tuple[float, str, float] | None = None  # (t, name, value) of the latest metric
    loss: LossRule = field(default_factory=LossRule)
    accept: AcceptRule = field(default_factory=AcceptRule)
    server: ServerRule = field(default_factory=ServerRule)
    resumed_at: float | None = None  # when this console saw it resume from a pause (its clock restarts)
    was_paused: bool = False
    stall_key: str | None = None
    idle_since: dict[int, float] = field(default_factory=dict)  # GPU index -> first idle sample's time
    idle_key: str | None = None


def stall(st: StageView, sw: StageWatch, rules: AlertsSection, now: float) -> Alert | None:
    """A running stage silent (no progress, no metric) for ``stall_minutes``."""
    if rules.stall_minutes <= 0 or st.service:
        return None
    metric_t = sw.metric[0] if sw.metric else 0.0
    if st.run is None and not (st.progress.t or metric_t):
        return None  # an operator command that never reports: silence is its normal
    last = max(st.started_at or 0.0, st.progress.t, metric_t, sw.resumed_at or 0.0)
    if not last or now - last < rules.stall_minutes * 60:
        sw.stall_key = None
        return None
    key = f"stalled:{st.id}:{sw.attempt}:t{int(last)}"
    if key == sw.stall_key:
        return None
    sw.stall_key = key
    p = st.progress
    evidence = [f"rule: no progress and no metric for {rules.stall_minutes:g} min"]
    if p.t:
        total = f"/{p.total:g}" if p.total else ""
        evidence.append(f"last progress {p.done:g}{total} {p.unit} {fmt.duration(now - p.t)} ago")
    else:
        evidence.append("no progress reported in this attempt")
    if sw.metric:
        t, name, value = sw.metric
        evidence.append(f"last metric {name} = {_num(value)} {fmt.duration(now - t)} ago")
    if st.log:
        evidence.append(f"last log line: {st.log[-1][:200]}")
    return Alert(
        key,
        "stalled",
        f"{st.id}: no progress for {fmt.duration(now - last)}",
        f"{st.id} attempt {sw.attempt} is running but has reported nothing for {fmt.duration(now - last)}",
        st.id,
        sw.attempt,
        tuple(evidence),
    )


def gpu_idle(st: StageView, sw: StageWatch, tel: TelemetryModel, rules: AlertsSection) -> Alert | None:
    """GPUs allocated to a running stage that sit idle for ``gpu_idle_minutes`` (samples' own clock)."""
    if rules.gpu_idle_minutes <= 0 or st.service or not st.gpus:
        return None
    for idx in st.gpus:
        gv = tel.gpus.get(idx)
        if gv is None or gv.util is None:
            continue
        if gv.util > rules.gpu_idle_util:
            sw.idle_since.pop(idx, None)
        elif idx not in sw.idle_since:  # back-dated over the idle samples already read (an attach)
            n = 0
            for u in reversed(gv.util_hist):
                if u > rules.gpu_idle_util:
                    break
                n += 1
            sw.idle_since[idx] = gv.t - max(0, n - 1) * tel.interval_s
    start = st.started_at or 0.0
    long = {
        i: tel.gpus[i].t - max(t0, start)
        for i, t0 in sw.idle_since.items()
        if i in tel.gpus and tel.gpus[i].t - max(t0, start) >= rules.gpu_idle_minutes * 60
    }
    if not long:
        sw.idle_key = None
        return None
    since = min(max(sw.idle_since[i], start) for i in long)
    key = f"gpu-idle:{st.id}:{sw.attempt}:t{int(since)}"
    if key == sw.idle_key:
        return None
    sw.idle_key = key
    gpus = ", ".join(str(i) for i in sorted(long))
    return Alert(
        key,
        "gpu-idle",
        f"{st.id}: GPU {gpus} idle",
        f"{st.id} attempt {sw.attempt} holds GPU {gpus}, idle for {fmt.duration(max(long.values()))}",
        st.id,
        sw.attempt,
        tuple(
            f"GPU {i}: utilisation {tel.gpus[i].util:g}% for {fmt.duration(d)}, memory "
            f"{fmt.size(tel.gpus[i].mem_used)}, processes: {', '.join(tel.gpus[i].owners) or 'none'}"
            for i, d in sorted(long.items())
        )
        + (f"rule: at or below {rules.gpu_idle_util:g}% for {rules.gpu_idle_minutes:g} min",),
    )


FORCED = "forced-start"


def forced_alert(st: StageView, ev: Event) -> Alert:
    """A stage started with ``--force`` (``Supervisor.launch``'s ``forced`` message)."""
    raw = ev.get("attempt")
    attempt = raw if isinstance(raw, int) and not isinstance(raw, bool) else (st.ev_attempt or st.attempt)
    return Alert(
        f"{FORCED}:{st.id}:{attempt}",
        FORCED,
        f"{st.id} started with --force",
        f"{st.id} attempt {attempt} started without the disk-budget and GPU-guard checks (aerie force)",
        st.id,
        attempt,
        (str(ev.get("text", "")),),
    )


class AnomalyWatcher:
    """Feeds the rules from the model: :meth:`on_event` per applied event, :meth:`check` after a poll."""

    def __init__(self, rules: AlertsSection | None = None) -> None:
        self.rules = rules or AlertsSection()
        self.stages: dict[str, StageWatch] = {}
        self.pending: list[Alert] = []

    def _watch(self, st: StageView) -> StageWatch:
        attempt = st.ev_attempt or st.attempt
        sw = self.stages.get(st.id)
        if sw is None or sw.attempt != attempt:
            sw = self.stages[st.id] = StageWatch(attempt)
        return sw

    def on_event(self, st: StageView, ev: Event) -> None:
        """One event the model applied to ``st`` (a listener of :class:`~console.model.RunModel`)."""
        if ev.type == "message" and ev.get("code") == "forced":
            if len(self.pending) < MAX_PENDING:
                self.pending.append(forced_alert(st, ev))
            return
        if ev.type not in ("metric", "health", "started"):
            return
        sw = self._watch(st)
        alert = None
        if ev.type == "health" and st.service:
            alert = sw.server.health(ev, st.id, sw.attempt)
        elif ev.type == "metric":
            name, raw = str(ev.get("name")), ev.get("value")
            if not isinstance(raw, int | float) or isinstance(raw, bool):
                return
            value = float(raw)
            sw.metric = (ev.t, name, value)
            if name == LOSS:
                sw.accept.feed_loss(value)
                alert = sw.loss.feed(value, ev, self.rules, st.id, sw.attempt)
            elif name == ACCEPT:
                alert = sw.accept.feed(value, ev, self.rules, st.id, sw.attempt)
            elif name == RUNNING_REQ:
                sw.server.running = value
            elif name == THROUGHPUT and ev.get("batch", "decode") == "decode":
                alert = sw.server.feed(value, ev, self.rules, st.id, sw.attempt)
        if alert is not None and len(self.pending) < MAX_PENDING:
            self.pending.append(alert)

    def still_on(self, alert: Alert) -> bool:
        """Whether ``alert``'s episode is still going on (its rule has not re-armed since)."""
        sw = self.stages.get(alert.stage)
        if sw is None or sw.attempt != alert.attempt:
            return False
        flags = {
            "loss-nonfinite": sw.loss.nonfinite,
            "loss-diverging": sw.loss.diverging,
            "accept-falling": sw.accept.falling,
            "server-throughput": sw.server.collapsed,
            "server-unhealthy": sw.server.unhealthy,
        }
        return flags.get(alert.kind, True)  # stalled, gpu-idle: check() finds them from the present

    def active(self, model: RunModel, now: float | None = None) -> list[Alert]:
        """The anomalies going on now, each with its evidence (``aerie status``: a watcher that has just read
        the events' tail). Unlike :meth:`check`, an episode already over is left out."""
        pending = [a for a in self.pending if self.still_on(a)]
        self.pending = pending
        return self.check(model, now)

    def check(self, model: RunModel, now: float | None = None) -> list[Alert]:
        """The anomalies found since the last check, for running stages only (a failure alerts anyway)."""
        now = time.time() if now is None else now
        # The latest episode of each rule per stage: attaching replays the events' tail, whose old
        # episodes would otherwise arrive as a burst of toasts.
        latest = {(a.stage, a.kind): a for a in self.pending}
        out = [
            a
            for a in latest.values()
            if (st := model.stages.get(a.stage)) is not None
            and (
                st.state == StageState.RUNNING or a.kind == FORCED
            )  # a forced start is news even if it ended
            and st.attempt == a.attempt
        ]
        self.pending = []
        # Slurm: the stages' GPUs are on other hosts than the supervisor sampling its own
        tel = model.telemetry if executors.gpu_telemetry_applies(model.executor) else None
        for st in model.stages.values():
            if st.state == StageState.PAUSED or st.pausing:
                if st.id in self.stages:
                    self.stages[st.id].was_paused = True
                continue
            if st.state != StageState.RUNNING or st.queued or st.id == model.telemetry_stage:
                continue
            sw = self._watch(st)
            if sw.was_paused:
                sw.was_paused, sw.resumed_at = False, now
            for alert in (stall(st, sw, self.rules, now), gpu_idle(st, sw, tel, self.rules) if tel else None):
                if alert is not None:
                    out.append(alert)
        return out
