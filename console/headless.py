"""Headless mode: the same run model without a UI, printing progress lines (CI, no terminal).

Prints one line per state change and a progress line per running stage every ``every_s``
seconds; returns 0 only when the run finished with every stage succeeded (or skipped).
Ctrl-C detaches: the stages keep running under their supervisor.

It watches the supervisor as the console does (:mod:`console.sup_watch`): a line when it falls silent, dies
and is restarted (a read-only watcher restarts nothing and says so), and a line for each alert it raises; and
a line for each of the run's alert records (raised on the executing host, :mod:`pipeline.run.alerts`) and when
it clears.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from console import fmt
from console.model import RunModel, StageView
from console.sup_watch import SupervisorWatch, open_alerts, rows_without_supervisor
from console.transport import Transport
from pipeline.run.rundir.protocol import Message, describe
from pipeline.run.rundir.stage_row import StageState

MAX_WARNINGS = 5  # per stage and attempt; errors are always printed


class _Printer:
    """What headless mode has said so far, so each state change, message, alert and verdict prints once."""

    def __init__(self, out: TextIO, every_s: float) -> None:
        self.out, self.every_s = out, every_s
        self.seen_state: dict[str, tuple[str, int]] = {}
        self.seen_events: dict[str, float] = {}
        self.last_progress: dict[str, float] = {}
        self.warned: dict[tuple[str, int], int] = {}
        self.said: str | None = None  # the supervisor verdict last printed
        self.alerts_seen: set[tuple[str, float]] = set()
        self.records_seen: dict[int, bool] = {}  # the run's alert records printed: id -> printed as cleared

    def emit(self, text: str) -> None:
        self.out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.out.flush()

    async def supervisor(self, model: RunModel, watch: SupervisorWatch, transport: Transport) -> None:
        """A line when the supervisor is restarted, when its verdict changes, and per new alert it raises."""
        watch.observe(model.supervisor_t)
        if watch.due(model.done):
            rep = await watch.check(transport)
            if rep.get("started"):
                self.emit(f"supervisor: {rep.get('text')} — started a new one")
        line = watch.line(model.done)
        kind = None if line is None else str((watch.report or {}).get("verdict", "checking"))
        if line is not None and kind != self.said:  # once per change of verdict, not per changing count
            self.emit(line[0])
        elif line is None and self.said is not None:
            self.emit("supervisor: writing its snapshot again")
        self.said = kind
        for a in open_alerts(model.supervisor_alerts):
            key = (str(a.get("code")), float(a.get("since") or 0))
            if key not in self.alerts_seen:
                self.alerts_seen.add(key)
                self.emit(f"supervisor alert: {a.get('text')}")

    def alerts(self, model: RunModel) -> None:
        """A line per alert record raised on the executing host, and one when it clears."""
        for rid in sorted(model.alerts.book):
            r = model.alerts.book[rid]
            if rid not in self.records_seen:
                self.emit(f"alert #{rid} {r.kind} {r.stage or ''}: {r.text}".replace("  ", " "))
                for line in r.evidence:
                    self.emit(f"    {line}")
                self.records_seen[rid] = False
            if not r.open and not self.records_seen[rid]:
                self.records_seen[rid] = True
                self.emit(f"alert #{rid} {r.kind} cleared")

    def stage(self, sid: str, st: StageView, now: float) -> None:
        """One stage's new state, its new warnings and errors, and (running) its progress every ``every_s``."""
        key = (st.display_state, st.attempt)
        if self.seen_state.get(sid) != key:
            self.seen_state[sid] = key
            extra = (
                f" — {st.reason}"
                if st.reason and st.state not in (StageState.RUNNING, StageState.SUCCEEDED)
                else ""
            )
            self.emit(
                f"{sid:<28} {st.display_state}"
                + (f" (attempt {st.attempt})" if st.attempt > 1 else "")
                + extra
            )
        self.messages(sid, st)
        if (
            st.state == StageState.RUNNING
            and st.progress.t
            and now - self.last_progress.get(sid, 0) >= self.every_s
        ):
            self.last_progress[sid] = now
            p = st.progress
            eta = p.eta_s(now)  # a stage silent past a minute: its rate decays, its ETA grows
            self.emit(
                f"{sid:<28} {fmt.count(p.done)}/{fmt.count(p.total)} {p.unit}"
                f"  {fmt.rate(p.rate(now), p.unit)}"
                + (f"  ETA {fmt.duration(eta)}" if eta is not None else "")
            )

    def messages(self, sid: str, st: StageView) -> None:
        """The stage's new warning and error messages: every error, the first ``MAX_WARNINGS`` warnings."""
        for ev in st.events:
            if (
                ev.t > self.seen_events.get(sid, 0.0)
                and isinstance(ev, Message)
                and ev.level in ("warning", "error")
            ):
                n = self.warned.get((sid, st.attempt), 0)
                self.warned[(sid, st.attempt)] = n + 1
                if ev.level == "error" or n < MAX_WARNINGS:
                    self.emit(f"{sid:<28} {describe(ev)}")
                elif n == MAX_WARNINGS:
                    self.emit(f"{sid:<28} (more warnings: see stages/{sid}/events.jsonl)")
        if st.events:
            self.seen_events[sid] = max(self.seen_events.get(sid, 0.0), st.events[-1].t)

    def summary(self, model: RunModel) -> int:
        """The finished run's verdict, why each failed stage failed, and the accepted lengths; the exit code."""
        ok = model.all_succeeded()
        counts = ", ".join(f"{n} {s}" for s, n in sorted(model.counts().items()))
        self.emit(f"run {'succeeded' if ok else 'did not succeed'}: {counts}")
        for sid in model.order:  # why, once more at the end: the state lines may have scrolled away
            st = model.stages[sid]
            if st.state in (StageState.FAILED, StageState.KILLED):
                self.emit(f"  {sid} {st.state}: {st.reason or 'no reason recorded'}")
        for sid in model.order:
            st = model.stages[sid]
            if "accept_len" in st.metrics:
                self.emit(f"{sid}: mean accepted length {st.metrics['accept_len']:.3f}")
        return 0 if ok else 1


async def follow(
    transport: Transport,
    out: TextIO = sys.stdout,
    poll_s: float = 0.5,
    every_s: float = 10.0,
    timeout_s: float | None = None,
    read_only: bool = False,
) -> int:
    """Print the run's progress until it finishes (0: every stage succeeded, else 1) or ``timeout_s`` passes."""
    model = RunModel(transport, backfill=False)  # no curves here: no need for the metric history's past
    printer = _Printer(out, every_s)
    watch = SupervisorWatch(read_only)
    if not read_only:  # a read-only watcher does not even restart a dead supervisor
        await watch.check(transport)
    start = time.monotonic()
    while True:
        await model.poll()
        now = time.time()
        await printer.supervisor(model, watch, transport)
        if read_only and not model.loaded and (watch.report or {}).get("verdict") in ("dead", "finished"):
            await rows_without_supervisor(model, transport)  # no snapshot, no supervisor: the stages' files
        for sid in model.order:
            printer.stage(sid, model.stages[sid], now)
        printer.alerts(model)
        if model.loaded and model.done:
            return printer.summary(model)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            printer.emit(f"timed out after {timeout_s:g}s; the run keeps going")
            return 1
        await asyncio.sleep(poll_s)


def run_headless(transport: Transport, **kw: object) -> int:
    try:
        return asyncio.run(follow(transport, **kw))  # type: ignore[arg-type]
    except KeyboardInterrupt:
        print(
            f"\ndetached; the run keeps going. Re-attach: aerie attach {transport.run_root}", file=sys.stderr
        )
        return 130
