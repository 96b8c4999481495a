"""The metric rules: a loss that turns NaN or diverges, acceptance falling while the loss falls, an inference
server whose throughput collapses or whose health turns bad — each fed one event at a time.

One small rule per anomaly; each fires once per episode with its evidence and re-arms when its
condition clears (``docs/operating.md``, "On day four", says what each means and what to do). The
thresholds are the plan's ``[alerts]`` keys (:class:`~pipeline.run.plan.sections.AlertsSection`):

* **loss-nonfinite**: a ``loss`` metric that is NaN or ±inf.
* **loss-diverging** (``diverge_factor``, ``diverge_window``): the loss above ``diverge_factor`` times
  its minimum over the previous ``diverge_window`` logged points, :data:`CONFIRM` points in a row, once
  at least :data:`MIN_POINTS` points are known.
* **accept-falling** (``accept_window``, ``accept_drop``): over the last ``accept_window`` evaluations
  the train stage's ``accept_length`` never rose and fell by ``accept_drop`` (relative) or more, while
  the ``loss`` at those evaluations fell — the draft is learning the data, not the target's choices.
* **server-throughput** (``throughput_fraction``, ``throughput_window``): the server's decode
  ``gen_throughput`` below that fraction of its median over the last ``throughput_window`` samples,
  :data:`CONFIRM` samples in a row, while requests run (at least half as many as the median, so a
  lighter load is not a collapse). **server-unhealthy**: a running server whose health turned unhealthy.

The rules of a stage's clock and state (stalled, failed, forced start, idle GPUs, disk, the train-versus-serve
gap) are :mod:`pipeline.run.alerts.stage_rules`. Each is fed the typed events of the run protocol
(:mod:`pipeline.run.rundir.protocol`), never a ``type`` string. Constant work per event (a median of at most
``throughput_window`` numbers per throughput sample). An alert's key names its episode by data every reader
sees alike (the step, or the time it began), so a restarted watcher that reads the events again finds the
episodes it already recorded. Pure: no files, no processes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from pipeline.run.alerts.record import Alert
from pipeline.run.plan.sections import AlertsSection
from pipeline.run.rundir.protocol import Health, Metric
from pipeline.run.rundir.stage_row import HealthState

# The train stage's metric names (pipeline/stages/train), the serve stage's (pipeline/serving/sglang_log.py).
LOSS, ACCEPT = "loss", "accept_length"
THROUGHPUT, RUNNING_REQ = "gen_throughput", "running_req"
CONFIRM = 2  # points in a row a loss or throughput rule must hold: one spike is not a trend
MIN_POINTS = 5  # points a minimum or median needs before it is trusted (fewer where the window is smaller)
MAX_PENDING = 100


def _num(v: float) -> str:
    return f"{v:.4g}"


def _at(ev: Metric) -> tuple[str, str]:
    """(the episode part of a key, the words for where) of a metric event: its step, else its time."""
    step = ev.step
    if step is not None:
        return f"step{int(step)}", f"step {int(step)}"
    return f"t{ev.t:.3f}", time.strftime("%H:%M:%S", time.localtime(ev.t))


class LossRule:
    """NaN/inf loss, and divergence from the loss's recent minimum."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, str]] = deque(maxlen=AlertsSection.diverge_window)
        self.over: deque[tuple[float, str, str]] = deque(maxlen=CONFIRM)
        self.nonfinite = False  # in a NaN episode (re-armed by the next finite loss)
        self.diverging = False  # in a divergence episode (re-armed once the loss is back under the line)

    def feed(self, value: float, ev: Metric, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
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

    def feed(self, value: float, ev: Metric, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
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

    def feed(self, value: float, ev: Metric, rules: AlertsSection, sid: str, attempt: int) -> Alert | None:
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

    def health(self, ev: Health, sid: str, attempt: int) -> Alert | None:
        state = ev.state
        if state != HealthState.UNHEALTHY:
            self.unhealthy = False
            return None
        if self.unhealthy:
            return None
        self.unhealthy = True
        detail = str(ev.data.get("detail") or "failed health probes in a row")
        return Alert(
            f"server-unhealthy:{sid}:{attempt}:t{ev.t:.3f}",
            "server-unhealthy",
            f"{sid}: server unhealthy",
            f"{sid} attempt {attempt}: the server stopped answering its health probe",
            sid,
            attempt,
            (f"health: unhealthy at {time.strftime('%H:%M:%S', time.localtime(ev.t))}: {detail}",),
        )
