"""How each display state looks and sorts: the console's one table of them.

A stage is shown as a :class:`~pipeline.run.rundir.stage_row.DisplayState` (its state, or for a running stage
the finer word: pausing, starting, a service's health). :data:`DISPLAY` says, per state, where a family
row ranks it (the state most needing the operator's eye wins), where the per-dataset table sorts it,
the theme colour it falls back to when a theme sets no ``state-<name>``, whether it is drawn bold, and
whether it keeps a folded family's member listed. The board, the dataset table and the theme read
this table and nothing else. Pure data: no Textual import.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.run.rundir.stage_row import DisplayState as D


@dataclass(frozen=True)
class Look:
    """How one display state is shown."""

    dataset_rank: int  # the per-dataset table's sort: lower first
    colour: str  # the theme variable used when the theme sets no state-<name>
    bold: bool = False  # a state that needs the operator (failed, killed ...)
    attention: bool = False  # stays listed under a folded family


# In family precedence: a family row shows the first of these that any of its members is in.
DISPLAY: dict[D, Look] = {
    D.FAILED: Look(0, "error", bold=True, attention=True),
    D.KILLED: Look(1, "error", bold=True, attention=True),
    D.UNHEALTHY: Look(2, "error", bold=True, attention=True),
    D.PAUSED: Look(4, "warning", attention=True),
    D.PAUSING: Look(3, "warning", attention=True),
    D.RUNNING: Look(3, "primary", attention=True),
    D.STARTING: Look(3, "primary", attention=True),
    D.READY: Look(3, "success"),
    D.UPSTREAM_FAILED: Look(6, "error", bold=True),
    D.PENDING: Look(5, "foreground-muted"),
    D.SUCCEEDED: Look(7, "success"),
    D.SKIPPED: Look(8, "foreground-muted"),
    D.STOPPED: Look(5, "foreground"),
}
# A state this version does not know (a newer supervisor's): sorted with the pending, drawn plain.
UNKNOWN = Look(5, "foreground")

FAMILY_PRECEDENCE: tuple[D, ...] = tuple(s for s in DISPLAY if s is not D.STOPPED)
ATTENTION = frozenset(s for s, look in DISPLAY.items() if look.attention)


def look(state: str) -> Look:
    """How ``state`` (a display state, or a word this version does not know) is shown."""
    try:
        return DISPLAY[D(state)]
    except ValueError:
        return UNKNOWN
