"""Headless mode: the same run model without a UI, printing progress lines (CI, no terminal).

Prints one line per state change and a progress line per running stage every ``every_s``
seconds; returns 0 only when the run finished with every stage succeeded (or skipped).
Ctrl-C detaches: the stages keep running under their supervisor.

It watches the supervisor as the console does (:mod:`console.sup_watch`): a line when it falls silent, dies
and is restarted (a read-only watcher restarts nothing and says so), and a line for each alert it raises.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from console import fmt
from console.model import RunModel, describe_event
from console.sup_watch import SupervisorWatch, open_alerts
from console.transport import Transport
from pipeline.run.rundir.stage_row import StageState

MAX_WARNINGS = 5  # per stage and attempt; errors are always printed


async def follow(
    transport: Transport,
    out: TextIO = sys.stdout,
    poll_s: float = 0.5,
    every_s: float = 10.0,
    timeout_s: float | None = None,
    read_only: bool = False,
) -> int:
    model = RunModel(transport, backfill=False)  # no curves here: no need for the metric history's past
    seen_state: dict[str, tuple[str, int]] = {}
    seen_events: dict[str, float] = {}
    last_progress: dict[str, float] = {}
    warned: dict[tuple[str, int], int] = {}
    watch = SupervisorWatch(read_only)
    if not read_only:  # a read-only watcher does not even restart a dead supervisor
        await watch.check(transport)
    said: str | None = None
    alerts_seen: set[tuple[str, float]] = set()
    start = time.monotonic()

    def emit(text: str) -> None:
        out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        out.flush()

    while True:
        await model.poll()
        now = time.time()
        watch.observe(model.supervisor_t)
        if watch.due(model.done):
            rep = await watch.check(transport)
            if rep.get("started"):
                emit(f"supervisor: {rep.get('text')} — started a new one")
        line = watch.line(model.done)
        kind = None if line is None else str((watch.report or {}).get("verdict", "checking"))
        if line is not None and kind != said:  # once per change of verdict, not per changing count
            emit(line[0])
        elif line is None and said is not None:
            emit("supervisor: writing its snapshot again")
        said = kind
        for a in open_alerts(model.supervisor_alerts):
            key = (str(a.get("code")), float(a.get("since") or 0))
            if key not in alerts_seen:
                alerts_seen.add(key)
                emit(f"supervisor alert: {a.get('text')}")
        for sid in model.order:
            st = model.stages[sid]
            key = (st.display_state, st.attempt)
            if seen_state.get(sid) != key:
                seen_state[sid] = key
                extra = (
                    f" — {st.reason}"
                    if st.reason and st.state not in (StageState.RUNNING, StageState.SUCCEEDED)
                    else ""
                )
                emit(
                    f"{sid:<28} {st.display_state}"
                    + (f" (attempt {st.attempt})" if st.attempt > 1 else "")
                    + extra
                )
            for ev in st.events:
                if (
                    ev.t > seen_events.get(sid, 0.0)
                    and ev.type == "message"
                    and ev.get("level") in ("warning", "error")
                ):
                    n = warned.get((sid, st.attempt), 0)
                    warned[(sid, st.attempt)] = n + 1
                    if ev.get("level") == "error" or n < MAX_WARNINGS:
                        emit(f"{sid:<28} {describe_event(ev)}")
                    elif n == MAX_WARNINGS:
                        emit(f"{sid:<28} (more warnings: see stages/{sid}/events.jsonl)")
            if st.events:
                seen_events[sid] = max(seen_events.get(sid, 0.0), st.events[-1].t)
            if (
                st.state == StageState.RUNNING
                and st.progress.t
                and now - last_progress.get(sid, 0) >= every_s
            ):
                last_progress[sid] = now
                p = st.progress
                eta = p.eta_s()
                emit(
                    f"{sid:<28} {fmt.count(p.done)}/{fmt.count(p.total)} {p.unit}"
                    f"  {fmt.rate(p.rate(), p.unit)}"
                    + (f"  ETA {fmt.duration(eta)}" if eta is not None else "")
                )
        if model.loaded and model.done:
            ok = model.all_succeeded()
            counts = ", ".join(f"{n} {s}" for s, n in sorted(model.counts().items()))
            emit(f"run {'succeeded' if ok else 'did not succeed'}: {counts}")
            for sid in model.order:  # why, once more at the end: the state lines may have scrolled away
                st = model.stages[sid]
                if st.state in (StageState.FAILED, StageState.KILLED):
                    emit(f"  {sid} {st.state}: {st.reason or 'no reason recorded'}")
            for sid in model.order:
                st = model.stages[sid]
                if "accept_len" in st.metrics:
                    emit(f"{sid}: mean accepted length {st.metrics['accept_len']:.3f}")
            return 0 if ok else 1
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            emit(f"timed out after {timeout_s:g}s; the run keeps going")
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
