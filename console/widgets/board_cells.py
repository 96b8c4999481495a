"""The stage board's cells: what each column says of a stage (the note: why it waits, why it failed, the
inference server's live line) and how a cell is drawn at a width (a progress bar, a value cut with "…").
Pure text; :mod:`console.widgets.board` lays the rows out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.cells import cell_len, set_cell_size
from rich.text import Text

from console import fmt
from console.model import StageView
from console.states import ATTENTION
from pipeline.run.rundir.protocol import Message
from pipeline.run.rundir.stage_row import StageState
from pipeline.serving.sglang_log import ServerStats

BAR_WIDE, BAR_NARROW = 12, 6


class _Bar(str):
    """A progress cell: the fraction, drawn at the width the board can afford (see :func:`_bar`)."""

    fraction: float | None

    def __new__(cls, fraction: float | None) -> _Bar:
        obj = super().__new__(cls, _bar(fraction))
        obj.fraction = fraction
        return obj


Cell = str | Text


def server_line(st: StageView) -> str | None:
    """The inference server's live line (tok/s, running, queued, token usage, accept length)."""
    m = st.metrics
    if not st.service or not any(k in m for k in ("gen_throughput", "running_req", "queue_req")):
        return None
    stats = ServerStats(
        gen_throughput=m.get("gen_throughput"),
        running_req=m.get("running_req"),
        queue_req=m.get("queue_req"),
        token_usage=m.get("token_usage"),
        accept_len=m.get("accept_len"),
        requests=int(m.get("requests", 0)),
    )
    return stats.line()


FORCED_MARK = "⚑ force armed"  # ``aerie force`` armed on a stage that has not started (F or --cancel disarms)


def note_for(st: StageView) -> str:
    if st.force_armed:
        return f"{FORCED_MARK} · {st.reason}" if st.reason else FORCED_MARK
    if st.queued:  # "queued: Slurm job 12 pending (Resources)"
        return st.reason
    live = server_line(st) if st.state in (StageState.RUNNING, StageState.PAUSED) else None
    if live:
        return live
    if st.state == StageState.SUCCEEDED and "accept_len" in st.metrics:
        return f"accept len {st.metrics['accept_len']:.2f}"
    if (
        st.state in (StageState.PENDING, StageState.FAILED, StageState.KILLED, StageState.UPSTREAM_FAILED)
        and st.reason
    ):
        extra = ""
        if st.retry_at:
            extra = f" · auto-retry in {fmt.duration(max(0, st.retry_at - time.time()))}"
        return st.reason + extra
    warned = last_warning(st) if st.state == StageState.SUCCEEDED else None
    if warned:  # done, with something to know (the demo's swe-agent regen: every prompt too long, none sent)
        return f"⚠ {warned}"
    if st.rejects:
        return f"{st.rejects} rejects"
    for key in ("loss", "tok_s", "accept_len"):
        if key in st.metrics:
            return f"{key} {st.metrics[key]:.4g}"
    if st.gpus and st.state in (StageState.RUNNING, StageState.PAUSED):
        return "GPUs " + ",".join(map(str, st.gpus))
    return ""


def alerted_note(st: StageView, kinds: list[str] | None, style: str) -> str | Text:
    """The note; a stage with an open alert (the run's records) says so first: ``⚠ stalled · …``. A kind the
    State column already says (``stage-failed`` on a failed row) is left to the mark alone, so the row's
    room goes to why it failed: ``⚠ exit 1: KeyError …``."""
    note = note_for(st)
    if not kinds:
        return note
    said = [k for k in kinds if not (k == "stage-failed" and st.state == StageState.FAILED)]
    mark = Text(f"⚠ {', '.join(said)}" if said else "⚠", style="bold " + style)
    return mark + Text((" · " if said else " ") + note if note else "")


def last_warning(st: StageView) -> str | None:
    """The text of the last warning the stage's current attempt wrote (a ``message`` event of level warning)."""
    for ev in reversed(st.events):
        if isinstance(ev, Message) and ev.level == "warning" and ev.code != "forced":
            return ev.text or None
    return None


def _sig(cells: tuple[Cell, ...]) -> tuple:
    """A hashable signature of a row's content (Rich Text is not hashable)."""
    return tuple(
        (c.plain, str(c.style), tuple((sp.start, sp.end, str(sp.style)) for sp in c.spans))
        if isinstance(c, Text)
        else c
        for c in cells
    )


@dataclass
class _Row:
    key: str
    cells: tuple[Cell, ...]
    sig: tuple = ()

    def __post_init__(self) -> None:
        self.sig = _sig(self.cells)


def _bar(frac: float | None, width: int = BAR_WIDE) -> str:
    if frac is None:
        return ""
    return f"{fmt.bar(frac, width)} {frac * 100:3.0f}%"


def _fit(s: str, w: int) -> str:
    """``s`` in ``w`` cells as Rich would lay the cell out: cut to ``w - 1`` cells with "…", then padded."""
    if cell_len(s) > w - 1:
        s = set_cell_size(s, w - 2) + "…"
    return s + " " * (w - cell_len(s))


def _plain_len(cell: Cell) -> int:
    return cell.cell_len if isinstance(cell, Text) else len(cell)


def needs_a_look(st: StageView) -> bool:
    """Whether a member stays listed under its folded family: its state needs attention (:data:`ATTENTION`:
    failed, running …), a force is armed on it (⚑, to be seen and disarmed), or it succeeded having done none
    of its work, with a warning saying why — its ⚠ reason must show (the demo's swe-agent regen skipped every
    prompt on purpose). A member that did its work and warned on the way (a prep that rejected a row: every
    prep of the demo does) folds away like the others; its note shows when the family is unfolded."""
    if st.display_state in ATTENTION:
        return True
    if st.force_armed:
        return True
    return st.state == StageState.SUCCEEDED and not st.progress.done and last_warning(st) is not None


def auto_folds(families: list[tuple[str, list[StageView]]], folds: dict[str, bool], room: int) -> set[str]:
    """The families to fold so that the board's rows fit ``room`` (0: no limit), leaving alone those the
    operator folded or unfolded (``folds``): first the ones with no member needing a look, then all.
    A folded family is its header row and its members that need a look (:func:`needs_a_look`)."""
    out: set[str] = set()
    if not room:
        return out
    groups = [(fam, ms) for fam, ms in families if len(ms) > 1 and fam not in folds]

    def rows() -> int:
        n = 0
        for fam, ms in families:
            if len(ms) == 1:
                n += 1
            elif folds.get(fam, fam in out):
                n += 1 + sum(1 for m in ms if needs_a_look(m))
            else:
                n += 1 + len(ms)
        return n

    quiet = [fam for fam, ms in groups if not any(needs_a_look(m) for m in ms)]
    for batch in (quiet, [fam for fam, _ms in groups]):
        if rows() <= room:
            break
        out |= set(batch)
    return out
