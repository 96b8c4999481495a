"""The console's two top lines as text: the header (run, connection, run dir, state counts) and the status
line (the run's outcome, or the supervisor's liveness). Pure functions of the model: the app sets them."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text

from console.model import RunModel

STALE_SUPERVISOR_S = 15.0  # no snapshot for this long: the console restarts the supervisor


def header_text(model: RunModel, connection: str, width: int, style: Callable[[str], str]) -> Text:
    """``run · connection · run dir · counts``; the run dir gives way (its start becomes "…") so the counts fit."""
    counts = Text()
    for state, n in sorted(model.counts().items()):
        counts.append(f" {n} {state} ", style=style(state))
    t = Text()
    t.append(f" {model.run_name or 'Aerie'} ", style="bold")
    t.append(f" {connection} ")
    room = width - 2 - t.cell_len - counts.cell_len - 2
    path = str(model.run_dir)
    if len(path) > room:
        path = "…" + path[-max(0, room - 1) :] if room > 8 else ""
    if path:
        t.append(f" {path} ", style="dim")
    t.append_text(counts)
    return t


def status_text(
    model: RunModel, poll_s: float, style: Callable[[str], str], now: float | None = None
) -> Text:
    """The run's error or outcome, else whether the supervisor still answers."""
    now = time.time() if now is None else now
    line = Text()
    if model.error:
        line.append(model.error, style=style("failed"))
    elif not model.loaded:
        line.append("waiting for the supervisor's first snapshot…")
    elif model.done:
        ok = model.all_succeeded()
        line.append(
            "run finished: " + ("every stage succeeded" if ok else "some stages did not succeed"),
            style=style("succeeded" if ok else "failed"),
        )
    elif model.supervisor_t and now - model.supervisor_t > STALE_SUPERVISOR_S:
        line.append(
            f"supervisor silent for {now - model.supervisor_t:.0f}s — restarting it",
            style=style("paused"),
        )
    else:
        line.append(f"supervisor pid {model.supervisor_pid} · polling every {poll_s:g}s")
    return line
