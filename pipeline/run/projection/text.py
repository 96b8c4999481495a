"""The run projection (:mod:`pipeline.run.projection.compute`) as words: the console header's one compact line and the
lines ``aerie status`` prints. Pure functions of a :class:`RunProjection`; the clock times are local time."""

from __future__ import annotations

import time

from pipeline.run.projection.compute import RunProjection

SEP = " · "
LISTED = 8  # stage ids a line names before "… and N more" (``aerie status --json`` has them all)
ROWS = 20  # per-stage estimate lines before "… and N more"


def use_percent(used: int, avail: int) -> int:
    """``df``'s ``Use%``: used / (used + avail) in whole per cent, rounded up as ``df`` rounds (29.2 % is
    30 %), in integers so that an exact 27 % stays 27; 0 for an empty filesystem."""
    room = used + avail
    if room <= 0:
        return 0
    return -(-max(0, used) * 100 // room)


def disk_at_end(p: RunProjection) -> str | None:
    """The projection's disk in ``df``'s terms, as the disk meter says it now: ``33% used, 71.8 GiB free``
    at the finish — or how much the stages still to write are short of; None with no disk reading."""
    if p.disk_at_finish is None:
        return None
    if p.disk_free_at_finish is None:  # a host whose Aerie predates it: only the bytes used
        return f"{size(p.disk_at_finish)} used" + (f" of {size(p.disk_total)}" if p.disk_total else "")
    free = p.disk_free_at_finish
    if free < 0:
        return f"{size(-free)} short: the stages still to run write more than is free"
    return f"{use_percent(p.disk_at_finish, free)}% used, {size(free)} free"


def ids(names: list[str], shown: int = LISTED) -> str:
    """``a, b, c`` — or ``a, b, … and 2,988 more`` for a long list, so one line stays one line."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} … and {len(names) - shown:,} more"


def duration(s: float) -> str:
    """45s, 12m, 3h12m, 2d04h: the two largest units, no more."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    m = int(s // 60)
    if m < 60:
        return f"{m}m"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def span(seconds: float) -> str:
    """A time span as people say it: ``45s``, ``12m 05s``, ``5h 03m``, ``4d 19h`` (never ``415833s``)."""
    sec = max(0, int(seconds))
    if sec < 60:
        return f"{sec}s"
    m, sec = divmod(sec, 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h"


def clock(t: float, now: float) -> str:
    """A time near ``now`` as people plan by: 14:05 today, Tue 14:05 this week, else 2026-12-03 14:05."""
    lt, ln = time.localtime(t), time.localtime(now)
    if lt.tm_yday == ln.tm_yday and lt.tm_year == ln.tm_year:
        return time.strftime("%H:%M", lt)
    if abs(t - now) < 6 * 86400:
        return time.strftime("%a %H:%M", lt)
    return time.strftime("%Y-%m-%d %H:%M", lt)


def size(n: float) -> str:
    """Bytes in binary units, short (1.2 TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _more(ids: list[str]) -> str:
    return ids[0] + (f" +{len(ids) - 1}" if len(ids) > 1 else "")


def finish_text(p: RunProjection) -> str:
    """When the run ends, or why it will not; "finish unknown" while a stage with no size is unfinished,
    whatever else failed."""
    no_size = (
        f"{_more(p.unknown_open)} report{'' if len(p.unknown_open) > 1 else 's'} no size"
        if p.unknown_open
        else ""
    )
    if p.unknown_open and p.blocked:
        return f"finish unknown: retry {_more(p.blocked)}; {no_size}"
    if p.blocked:
        return f"won't finish: retry {_more(p.blocked)}"
    if p.unknown_open:
        return f"finish unknown: {no_size}"
    if p.finished:
        return "ended" + (f", took {duration(p.finish_at - p.started_at)}" if p.started_at else "")
    if p.remaining_s < 1:
        return "finishing: the last stages are ending"
    when = f"finish {clock(p.finish_at, p.now)} ({duration(p.remaining_s)} left)"
    return f"{when}, later while {_more(p.paused)} paused" if p.paused else when


def parts(p: RunProjection) -> list[str]:
    """The compact line's facts, most important first."""
    head = (
        f"{p.progress:.0%} {p.stages_done}/{p.stages_total}"
        if p.progress is not None
        else f"{p.stages_done}/{p.stages_total} stages"  # no per cent to give: a stage's size is unknown
    )
    out = [head, finish_text(p)]
    if p.gpu_hours_projected is None:  # the finish is unknown: so is what the rest will use
        if p.gpu_hours_used > 0:
            out.append(f"{p.gpu_hours_used:.1f}/? GPU-h")
    elif p.gpu_hours_projected > 0:
        done = p.finished and not p.blocked
        out.append(
            f"{p.gpu_hours_used:.1f} GPU-h"
            if done
            else f"{p.gpu_hours_used:.1f}/{p.gpu_hours_projected:.1f} GPU-h"
        )
    disk = disk_at_end(p)
    if disk is not None:
        on = f" on {p.disk_mount.split(' ')[0]}" if p.disk_mount else ""  # the mount point, as the meter
        free = p.disk_free_at_finish
        short = free is not None and free < 0
        out.append(f"disk {size(-(free or 0))} short at end{on}" if short else f"disk at end{on}: {disk}")
    if p.blocked and not p.unknown_open:  # with a size-less stage to run, nobody knows how much more
        out.append(f"{duration(p.remaining_s)} more if retried now")
    if p.assumed and not p.finished:
        out.append(f"{len(p.assumed)} assumed")
    return out


def compact_line(p: RunProjection, width: int = 80) -> str:
    """One line of at most ``width`` cells: whole facts, the least important dropped first."""
    facts = parts(p)
    while facts:
        line = SEP.join(facts)
        if len(line) <= width:
            return line
        facts.pop()
    return ""


def status_lines(p: RunProjection) -> list[str]:
    """``aerie status``: the projection, then how each estimate was made."""
    done = f"{p.stages_done}/{p.stages_total} stages done"
    lines = [
        f"run: {p.progress:.0%} of the estimated work, {done}"
        if p.progress is not None
        else f"run: progress unknown ({ids(p.unknown_open)}: no size known), {done}"
    ]
    if p.unknown_open:
        retry = f"will not finish without a retry of {ids(p.blocked)}; " if p.blocked else ""
        lines.append(
            f"finish: unknown — {retry}{ids(p.unknown_open)} "
            f"{'reports' if len(p.unknown_open) == 1 else 'report'} no progress with a total (an "
            f"operator command can: StageContext.progress); the rest alone would take {duration(p.remaining_s)}"
        )
    elif p.blocked:
        lines.append(
            f"finish: will not finish without a retry of {ids(p.blocked)}; retried now: "
            f"{clock(p.finish_at, p.now)}, {duration(p.remaining_s)} from now"
        )
    elif p.finished:
        lines.append(f"finish: {finish_text(p)}")
    else:
        lines.append(
            f"finish: {clock(p.finish_at, p.now)}, {duration(p.remaining_s)} from now (critical path)"
        )
        if p.paused:
            lines.append(f"paused: {ids(p.paused)} (projected as if resumed now: the finish moves later)")
    projected = (
        "projected unknown (the finish is)"
        if p.gpu_hours_projected is None
        else f"{p.gpu_hours_projected:.2f} projected"
    )
    lines.append(f"GPU-hours: {p.gpu_hours_used:.2f} used, {projected}")
    disk = disk_at_end(p)
    if disk is not None:
        fits = p.disk_free_at_finish is not None and p.disk_free_at_finish >= 0
        of = f" of {size(p.disk_total)}" if p.disk_total and fits else ""  # "free of SIZE", as the meter
        on = f" on {p.disk_mount}" if p.disk_mount else ""
        lines.append(f"disk at finish, as df counts: {disk}{of}{on}")
    if not p.finished or p.blocked:
        shown = [
            e
            for e in p.stages
            if e.basis in ("measured", "assumed") and (e.remaining_s > 0 or e.state != "succeeded")
        ]
        for e in shown[:ROWS]:
            rate = f"{_num(e.rate)} {e.unit}/s ({e.rate_from})" if e.rate else ""
            what = f"{e.size:,.0f} {e.unit}" if e.size is not None else ""
            lines.append(f"  {e.id:<28} {e.basis:<8} {duration(e.remaining_s):>7} left  {what} at {rate}")
        if len(shown) > ROWS:
            lines.append(f"  … and {len(shown) - ROWS:,} more estimates (aerie status --json has them all)")
        if p.unknown:
            lines.append(f"  no estimate (no size known): {ids(p.unknown)}")
    return lines
