"""The run-level projection: overall progress, projected finish and remaining wall time, GPU-hours used
and projected, and disk at finish, from the plan, each stage's state and progress, and "now".

Pure: it reads no file and no clock (``aerie status`` on the executing host and the console's header
both feed it what they know; ``docs/operating.md``, "The run projection", is the user's account).

How each stage is estimated (its :attr:`StageEstimate.basis`):

* ``done``      it finished (succeeded, skipped); its wall time is what it took.
* ``measured``  its own progress: what is left (``total - done``) at its rate (the console's window of
  recent samples; else the average since the attempt started). A running stage silent for longer than
  :data:`STALL_GRACE_S` made no progress since: its rate decays with wall time
  (:meth:`StageProgress.measured_rate`): one that reported 1/10 and stalled does not keep "5s left". A stage that has not started (or has not
  reported a rate yet) whose kind (``run = "prep"`` …) has a measured rate in this run — an earlier or
  parallel stage of the same kind, same unit — is its planned size at that rate: also ``measured``.
* ``assumed``   no rate of its kind measured yet: its planned size at :data:`DEFAULT_RATES`.
* ``unknown``   no size to go by (a ``command`` that reports no progress with a total): while such a stage
  is unfinished (even failed, to be retried) the run's progress, finish and projected GPU-hours are ``None``
  (:attr:`RunProjection.unknown_open` names them), never "100 %, finish now". A command that reports
  ``done``/``total`` (``StageContext.progress``, ``$AERIE_EVENTS``) is ``measured`` like any stage.
* ``service``   a server runs until the last stage that uses it ends (a service nothing uses — the
  telemetry agent — until the run ends).

Planned sizes (:func:`planned_size`): prep a dataset's ``quota`` rows; regen its prompts (``quota``,
capped by ``[regen] max_records``); vocab the rows of the datasets upstream; extract those rows ×
:data:`ROW_FILL` × the row length (``[extract] max_length``, else ``[target]``), capped by ``[extract]
max_rows`` / ``max_tokens``; train ``[train] steps``; bench ``[bench]`` prompts.

The finish is the critical path: a stage not started starts when the last of its dependencies ends (or
now), so two branches in parallel finish with the longer one. Waits for CPU slots or GPUs are not
modelled (stages that queue for them finish later than projected). A failed or killed stage without a
scheduled retry means the run will not finish without a retry: :attr:`RunProjection.blocked` names it,
and the times are those of a retry started now. A paused stage is projected as if resumed now, so its
finish moves later while it stays paused (and its GPUs, held while paused, keep counting).

GPU-hours: wall time × the GPUs a stage holds (its ``gpus`` × ``nodes``), over the current attempt of
every stage that started (``state.json`` keeps the current attempt, so earlier attempts are not counted),
and projected: that plus each stage's remaining wall time × its GPUs (unknown while the finish is).
Disk at finish: in ``df``'s terms, as the console's disk meter (:class:`DiskNow`)."""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.run.plan.dag import Plan, StageSpec
from pipeline.run.rundir.stage_row import StageState

# Rates assumed for a stage kind no stage of this run has measured yet (units per second, per stage):
# order-of-magnitude figures from docs/performance.md (prep ~300 rows/s on one slot, extraction ~12k tok/s on
# one H200, a training step of an 8B draft ~0.5 s), deliberately round; the projection says "assumed".
DEFAULT_RATES: dict[str, tuple[float, str]] = {
    "prep": (300.0, "rows"),
    "regen": (2.0, "records"),
    "vocab": (2000.0, "rows"),
    "extract": (10000.0, "tokens"),
    "train": (1.0, "steps"),
    "bench": (0.5, "prompts"),
}
ROW_FILL = 0.5  # extract: a row is assumed to hold half the row length in tokens (rows are cut there)
STALL_GRACE_S = 60.0  # a running stage silent longer than this since its last report is stalling
RATE_SPAN_S = 120.0  # what a windowed rate is measured over (the console's RATE_WINDOW_S)
DONE = frozenset({StageState.SUCCEEDED, StageState.SKIPPED})
NEEDS_RETRY = frozenset({StageState.FAILED, StageState.KILLED})


def stall_decayed(rate: float, span: float, silent_s: float) -> float:
    """``rate`` (measured over ``span`` seconds up to the last report) once the stage has been silent for
    ``silent_s``: the silence past :data:`STALL_GRACE_S` counts as time with no progress, so the rate falls
    with wall time while the stage stays silent (the board's ETA and the projection alike)."""
    stalled = silent_s - STALL_GRACE_S
    return rate * span / (span + stalled) if stalled > 0 and span > 0 else rate


@dataclass(frozen=True)
class StageProgress:
    """What is known of one stage now: its ``state.json`` row's state, times and last progress."""

    state: str = StageState.PENDING
    started_at: float | None = None
    finished_at: float | None = None
    done: float | None = None
    total: float | None = None
    unit: str = ""
    t: float | None = None  # when the last progress was reported
    rate: float | None = None  # units/s measured over a recent window (the console); None: since start
    retry_at: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StageProgress:
        """From a ``state.json`` stage row (its ``progress`` is the current attempt's last event)."""
        prog = row.get("progress") or {}
        return cls(
            state=str(row.get("state", StageState.PENDING)),
            started_at=_num(row.get("started_at")),
            finished_at=_num(row.get("finished_at")),
            done=_num(prog.get("done")),
            total=_num(prog.get("total")),
            unit=str(prog.get("unit") or ""),
            t=_num(prog.get("t")),
            retry_at=_num(row.get("retry_at")),
        )

    def measured_rate(self, now: float) -> float | None:
        """Units per second: the windowed rate if given, else the average over the attempt so far; for a
        running stage silent past :data:`STALL_GRACE_S`, decayed by the silence (no progress since its last
        report: the rate falls with wall time while it stays silent)."""
        if self.rate is not None and self.rate > 0:
            rate, span = self.rate, RATE_SPAN_S
        else:
            # No rate over the recent window (a stage that reports rarely): the average since it started.
            if self.done is None or self.done <= 0 or self.started_at is None:
                return None
            end = self.finished_at if self.state in DONE and self.finished_at else (self.t or now)
            if end <= self.started_at:
                return None
            rate, span = self.done / (end - self.started_at), end - self.started_at
        if self.state == StageState.RUNNING and self.t is not None:
            rate = stall_decayed(rate, span, now - self.t)
        return rate


@dataclass(frozen=True)
class DiskNow:
    """The run directory's filesystem now and what the stages still have to write (``pipeline.run.supervise.budget``).

    In ``df``'s terms, as the disk meter: ``used`` the blocks in use, ``avail`` what the run may still write
    (None: ``total - used``); ``mount`` the filesystem (:func:`pipeline.run.supervise.budget.mount_of`)."""

    used: int
    total: int
    to_write: int
    mount: str = ""
    avail: int | None = None


@dataclass
class StageEstimate:
    id: str
    state: str
    basis: str  # done | measured | assumed | unknown | service (see the module docstring)
    start: float | None  # when it started, or is projected to
    end: float  # when it ended, or is projected to
    remaining_s: float  # its own wall time still to run (from now if running, else from its start)
    gpus: int
    size: float | None = None  # planned units (stages not started), or the progress total
    unit: str = ""
    rate: float | None = None  # units/s the estimate used
    rate_from: str = ""  # "own", "by prep.a", "mean of 3 prep stages", "default"


_ESTIMATE_FIELDS = fields(StageEstimate)


@dataclass
class RunProjection:
    now: float
    progress: float | None  # 0..1 of the estimated wall time of the work stages; None: unknown (unknown_open)
    stages_done: int
    stages_total: int
    started_at: float | None
    finish_at: float
    remaining_s: float
    finished: bool  # every stage ended (succeeded, skipped, or broken with no retry scheduled)
    blocked: list[str]  # failed/killed stages that need a retry for the run to finish
    paused: list[str]
    gpu_hours_used: float
    gpu_hours_projected: float | None  # None: unknown, as the finish is (unknown_open)
    disk_at_finish: int | None  # bytes used (df's Used) on the run dir's filesystem at the finish
    disk_total: int | None  # the filesystem's size
    disk_mount: str | None  # the filesystem the disk figures are about (its mount point, device)
    assumed: list[str]  # stages estimated from assumed rates
    unknown: list[str]  # stages with no estimate
    stages: list[StageEstimate] = field(default_factory=list)
    unknown_open: list[str] = field(default_factory=list)  # unknown stages still to run: finish unknown
    disk_free_at_finish: int | None = None  # df's Avail at the finish (negative: that much short)

    @property
    def will_finish(self) -> bool:
        return not self.blocked

    @property
    def finish_known(self) -> bool:
        """False while a stage with no size to go by has still to run: its end (and the run's) is a guess."""
        return not self.unknown_open

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not asdict's deep copy (0.5 s at 10,000 stages): scalars, lists of str, flat estimates.
        d = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name != "stages"}
        d["stages"] = [{f.name: getattr(s, f.name) for f in _ESTIMATE_FIELDS} for s in self.stages]
        d["will_finish"] = self.will_finish
        d["measured"] = [s.id for s in self.stages if s.basis == "measured"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunProjection:
        """Read :meth:`to_dict`'s object back (``aerie status`` gets it from the host as JSON)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and k != "stages"}
        kw.setdefault("disk_mount", None)  # a host whose Aerie predates it
        est = {f.name for f in fields(StageEstimate)}
        stages = [StageEstimate(**{k: v for k, v in e.items() if k in est}) for e in d.get("stages", [])]
        return cls(**kw, stages=stages)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


# ------------------------------------------------------------------------------------- sizes
def gpus_held(spec: StageSpec) -> int:
    """GPUs a stage holds while it runs: its GPU list on each of its nodes."""
    return len(spec.gpus) * max(1, spec.nodes)


def _dataset_rows(plan: Plan, name: str, regenerated: bool) -> int:
    quota = plan.dataset(name).quota
    cap = plan.settings.regen.max_records
    return min(quota, cap) if regenerated and cap else quota


def _upstream_rows(plan: Plan, spec: StageSpec) -> int:
    """Rows of the datasets the stage reads (a regenerated dataset: its answers)."""
    by_id = {s.id: s for s in plan.stages}
    seen: dict[str, bool] = {}
    for dep in spec.after:
        d = by_id.get(dep)
        if d is not None and d.dataset is not None and d.run in ("prep", "regen"):
            seen[d.dataset] = seen.get(d.dataset, False) or d.run == "regen"
    return sum(_dataset_rows(plan, name, regen) for name, regen in seen.items())


def planned_size(plan: Plan, spec: StageSpec) -> tuple[float, str] | None:
    """(units, unit) a stage will process, from the plan alone; ``None`` when the plan does not say."""
    s = plan.settings
    if spec.run == "prep" and spec.dataset:
        return float(plan.dataset(spec.dataset).quota), "rows"
    if spec.run == "regen" and spec.dataset:
        return float(_dataset_rows(plan, spec.dataset, True)), "records"
    if spec.run == "vocab":
        return float(_upstream_rows(plan, spec)), "rows"
    if spec.run == "extract":
        rows = _upstream_rows(plan, spec)
        if s.extract.max_rows:
            rows = min(rows, s.extract.max_rows)
        tokens = rows * ROW_FILL * (s.extract.max_length or plan.target.row_length)
        if s.extract.max_tokens:
            tokens = min(tokens, s.extract.max_tokens)
        return float(tokens), "tokens"
    if spec.run == "train":
        return float(s.train.steps), "steps"
    if spec.run == "bench":
        if s.bench.online:  # every batch's streams, each sending its requests in turn
            return float(sum(s.bench.batches) * s.bench.requests_per_stream), "requests"
        return float(s.bench.prompt_count(False)), "prompts"
    return None


def kind_rates(
    plan: Plan, progress: dict[str, StageProgress], now: float
) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """Rates measured in this run, by (stage kind, unit): (stage id, rate) of every stage that reported progress."""
    out: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for spec in plan.stages:
        p = progress.get(spec.id)
        if spec.run is None or p is None or p.state not in (*DONE, StageState.RUNNING, StageState.PAUSED):
            continue
        r = p.measured_rate(now)
        if r is not None and p.unit:
            out.setdefault((spec.run, p.unit), []).append((spec.id, r))
    return out


# ------------------------------------------------------------------------------- projection
def _order(plan: Plan) -> tuple[list[str], dict[str, list[str]]]:
    """The stages in an order where what a stage waits for comes first: its ``after`` and ``uses`` stages
    and, for a service it is ``after``, every user of that service (the service stops when they end)."""
    users: dict[str, list[str]] = {}
    for s in plan.stages:
        for u in s.uses:
            users.setdefault(u, []).append(s.id)
    specs = {s.id: s for s in plan.stages}
    deps: dict[str, set[str]] = {}
    for s in plan.stages:
        d = set(s.after) | set(s.uses)
        for a in s.after:
            if specs[a].service:
                d |= set(users.get(a, []))
        deps[s.id] = d - {s.id}
    waiting = {sid: len(d) for sid, d in deps.items()}
    children: dict[str, list[str]] = {}
    for sid, d in deps.items():
        for x in d:
            children.setdefault(x, []).append(sid)
    ready = deque(s.id for s in plan.stages if waiting[s.id] == 0)
    order: list[str] = []
    while ready:
        sid = ready.popleft()
        order.append(sid)
        for c in children.get(sid, []):
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    placed = set(order)  # a set: a list's `in` made this O(stages²), 0.6 s of `aerie status` at 10,000
    order += [s.id for s in plan.stages if s.id not in placed]  # a cycle through a service: keep going
    return order, users


def project(
    plan: Plan,
    progress: dict[str, StageProgress],
    now: float,
    disk: DiskNow | None = None,
) -> RunProjection:
    """The run's projection at ``now``; ``progress`` maps stage ids to what is known (missing: pending)."""
    specs = {s.id: s for s in plan.stages}
    rates = kind_rates(plan, progress, now)
    order, users = _order(plan)
    est: dict[str, StageEstimate] = {}
    services: list[str] = []
    for sid in order:
        spec = specs[sid]
        p = progress.get(sid) or StageProgress()
        ready = max(
            [now]
            + [_end(est, users, specs, d) for d in spec.after if d in est]
            + [est[u].start or now for u in spec.uses if u in est]
        )
        est[sid] = _estimate(spec, p, plan, rates, now, ready)
        if spec.service:
            services.append(sid)
    work = [e for e in est.values() if not specs[e.id].service]
    run_end = max([e.end for e in work], default=now)
    for sid in services:  # a service ends with its last user, one nothing uses with the run
        e = est[sid]
        if e.state not in DONE and e.state not in NEEDS_RETRY:
            e.end = max(e.start or now, _end(est, users, specs, sid) if users.get(sid) else run_end)
            e.remaining_s = max(0.0, e.end - max(e.start or now, now))
    finish = max([e.end for e in est.values()], default=now)
    started = [p.started_at for p in progress.values() if p.started_at is not None]
    blocked = [
        sid
        for sid in order
        if (progress.get(sid) or StageProgress()).state in NEEDS_RETRY
        and (progress.get(sid) or StageProgress()).retry_at is None
    ]
    states = {sid: (progress.get(sid) or StageProgress()).state for sid in specs}
    finished = all(
        st in DONE or st in NEEDS_RETRY or st == StageState.UPSTREAM_FAILED for st in states.values()
    ) and all((progress.get(s) or StageProgress()).retry_at is None for s in specs)
    complete = finished and not blocked  # over: nothing more will run, and nothing needs to
    if complete:
        finish = max((p.finished_at or 0.0 for p in progress.values()), default=now)
    # unfinished: anything but succeeded/skipped, a failed stage to be retried included (whatever else failed)
    unknown_open = [] if complete else [e.id for e in work if e.basis == "unknown" and e.state not in DONE]
    used = sum(_elapsed(progress.get(sid), now) * gpus_held(specs[sid]) for sid in specs) / 3600
    to_come = sum(e.remaining_s * e.gpus for e in est.values()) / 3600
    took = sum(_elapsed(progress.get(e.id), now) for e in work if e.state != StageState.SKIPPED)
    left = sum(e.remaining_s for e in work)
    return RunProjection(
        now=now,
        progress=1.0
        if complete
        else None
        if unknown_open
        else (took / (took + left) if took + left > 0 else 0.0),
        stages_done=sum(1 for st in states.values() if st in DONE),
        stages_total=len(specs),
        started_at=min(started) if started else None,
        finish_at=finish,
        remaining_s=0.0 if complete else max(0.0, finish - now),
        finished=finished,
        blocked=blocked,
        paused=[sid for sid in order if states[sid] == StageState.PAUSED],
        gpu_hours_used=used,
        gpu_hours_projected=None if unknown_open else used + (0.0 if complete else to_come),
        disk_at_finish=disk.used + disk.to_write if disk else None,
        disk_free_at_finish=(disk.total - disk.used if disk.avail is None else disk.avail) - disk.to_write
        if disk
        else None,
        disk_total=disk.total if disk else None,
        disk_mount=(disk.mount or None) if disk else None,
        assumed=[e.id for e in est.values() if e.basis == "assumed"],
        unknown=[e.id for e in est.values() if e.basis == "unknown"],
        stages=[est[sid] for sid in plan.order()],
        unknown_open=unknown_open,
    )


def _end(
    est: dict[str, StageEstimate], users: dict[str, list[str]], specs: dict[str, StageSpec], sid: str
) -> float:
    """When ``sid`` ends: a running service when its last user does (its users come first in the order)."""
    e = est[sid]
    if specs[sid].service and e.state not in DONE and users.get(sid):
        return max(est[u].end for u in users[sid] if u in est)
    return e.end


def _elapsed(p: StageProgress | None, now: float) -> float:
    """Wall time of the current attempt so far (to its end, if it ended)."""
    if p is None or p.started_at is None:
        return 0.0
    ended = p.state not in (StageState.RUNNING, StageState.PAUSED, StageState.READY)
    end = p.finished_at if ended and p.finished_at is not None else now
    return max(0.0, min(end, now) - p.started_at)


def _estimate(
    spec: StageSpec,
    p: StageProgress,
    plan: Plan,
    rates: dict[tuple[str, str], list[tuple[str, float]]],
    now: float,
    ready: float,
) -> StageEstimate:
    gpus = gpus_held(spec)
    if p.state in DONE:
        end = p.finished_at if p.finished_at is not None else now
        return StageEstimate(spec.id, p.state, "done", p.started_at, min(end, now), 0.0, gpus)
    live = p.state in (StageState.RUNNING, StageState.PAUSED, StageState.READY)
    if spec.service:
        return StageEstimate(spec.id, p.state, "service", p.started_at if live else ready, ready, 0.0, gpus)
    start = p.started_at if live else max(ready, p.retry_at or now)
    begin = now if live else start or now
    # Its own progress: what is left at its own rate (a failed stage's retry resumes where it was).
    own = p.measured_rate(now)
    if p.total is not None and p.done is not None and own:
        left = max(0.0, p.total - p.done) / own
        return StageEstimate(
            spec.id, p.state, "measured", start, begin + left, left, gpus, p.total, p.unit, own, "own"
        )
    size = planned_size(plan, spec)
    if size is None:
        return StageEstimate(spec.id, p.state, "unknown", start, begin, 0.0, gpus)
    units, unit = size
    measured = rates.get((spec.run or "", unit))
    if measured:
        rate, basis = sum(r for _sid, r in measured) / len(measured), "measured"
        src = f"by {measured[0][0]}" if len(measured) == 1 else f"mean of {len(measured)} {spec.run} stages"
    else:
        rate, basis, src = DEFAULT_RATES[spec.run or ""][0], "assumed", "default"
    left = units / rate if rate > 0 else 0.0
    if (
        live and p.started_at is not None
    ):  # running without a usable rate of its own: what it has spent counts
        left = max(0.0, left - (now - p.started_at))
    return StageEstimate(spec.id, p.state, basis, start, begin + left, left, gpus, units, unit, rate, src)
