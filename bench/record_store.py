"""The benchmark record's pure half: read ``bench/record.jsonl``, compare a run's figures with the best and
the last recorded on a comparable machine, flag the ones that got worse, and render the tables.

A record line is one run of ``bench/record.py``: ``commit`` (``git rev-parse HEAD``, ``+dirty`` when
tracked files differed), ``date`` (UTC ISO), ``machine`` (hostname, cpu, cores, python, torch) and
``figures`` (name → value, unit, which way is better, the run-to-run spread over its samples). Two machines
are comparable when they have the same CPU model and core count. A figure is WORSE when it moved the wrong
way by more than its tolerance: the larger of the two runs' spreads, the figure's own floor and a
relative floor (5 % by default) of the reference value — but never more than :data:`REL_CAP` (50 %) of
the reference value (or its floor): a figure worse by more than half its own value is WORSE whatever the
spread, so a loaded machine's wide spread cannot call a 2,000,000 % regression "same".

Nothing here runs a benchmark, a subprocess or reads the clock: ``bench/record.py`` does that and hands
the results in; ``tests/test_bench_record.py`` tests this module on record files it writes.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REL_FLOOR = 0.05
REL_CAP = 0.5  # a change larger than this share of the reference value is never noise
BETTER = ("lower", "higher")


class RecordError(ValueError):
    """A record file (or a run's result) that cannot be read: the message names the file and the line."""


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    better: str  # "lower" or "higher"
    spread: float  # max - min over the samples
    floor: float = 0.0  # the smallest change that means anything (a clock tick, a token)
    samples: tuple[float, ...] = ()


@dataclass(frozen=True)
class Machine:
    hostname: str
    cpu: str
    cores: int
    python: str
    torch: str

    def comparable(self, other: Machine) -> bool:
        return self.cpu == other.cpu and self.cores == other.cores

    def short(self) -> str:
        return f"{self.cores} cores, {self.cpu}"


@dataclass(frozen=True)
class Record:
    commit: str
    date: str
    machine: Machine
    figures: dict[str, Figure]
    extra: dict[str, Any] = field(default_factory=dict)  # load average, command, repeats, failed benchmarks


@dataclass(frozen=True)
class Row:
    """One figure of a run next to its history on comparable machines."""

    figure: Figure
    best: Figure | None
    last: Figure | None
    last_commit: str | None
    verdict: str  # "new", "same", "better" or "WORSE"
    tolerance: float | None


def figure_from_samples(
    name: str, unit: str, better: str, samples: Sequence[float], floor: float = 0.0
) -> Figure:
    """The median of the samples, and their spread (max - min)."""
    if better not in BETTER:
        raise RecordError(f"{name}: better must be one of {BETTER}, not {better!r}")
    if not samples:
        raise RecordError(f"{name}: no samples")
    bad = [s for s in samples if not isinstance(s, int | float) or not math.isfinite(s)]
    if bad:
        raise RecordError(f"{name}: samples must be finite numbers, got {bad}")
    vals = tuple(float(s) for s in samples)
    return Figure(name, statistics.median(vals), unit, better, max(vals) - min(vals), floor, vals)


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise RecordError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, kind) or isinstance(val, bool):
        raise RecordError(
            f"{where}: field {key!r} is {type(val).__name__}, not "
            + (" or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__)
        )
    return val


def parse_record(obj: Any, where: str) -> Record:
    """One decoded record line; ``where`` ("FILE:LINE") prefixes every error."""
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: a record is a JSON object, not {type(obj).__name__}")
    commit = _field(obj, "commit", str, where)
    date = _field(obj, "date", str, where)
    try:
        datetime.fromisoformat(date)
    except ValueError:
        raise RecordError(f"{where}: field 'date' is not an ISO date: {date!r}") from None
    m = _field(obj, "machine", dict, f"{where}")
    mw = f"{where}: machine"
    machine = Machine(
        _field(m, "hostname", str, mw),
        _field(m, "cpu", str, mw),
        _field(m, "cores", int, mw),
        _field(m, "python", str, mw),
        _field(m, "torch", str, mw),
    )
    figures: dict[str, Figure] = {}
    for i, f in enumerate(_field(obj, "figures", list, where)):
        fw = f"{where}: figures[{i}]"
        if not isinstance(f, dict):
            raise RecordError(f"{fw}: not an object")
        name = _field(f, "name", str, fw)
        fw = f"{where}: figure {name!r}"
        better = _field(f, "better", str, fw)
        if better not in BETTER:
            raise RecordError(f"{fw}: field 'better' must be one of {BETTER}, not {better!r}")
        nums = {k: float(_field(f, k, (int, float), fw)) for k in ("value", "spread")}
        if not all(math.isfinite(v) for v in nums.values()) or nums["spread"] < 0:
            raise RecordError(f"{fw}: value and spread must be finite, spread >= 0: {nums}")
        floor = float(f.get("floor", 0.0))
        samples = tuple(float(s) for s in f.get("samples", ()))
        figures[name] = Figure(
            name, nums["value"], _field(f, "unit", str, fw), better, nums["spread"], floor, samples
        )
    known = {"commit", "date", "machine", "figures"}
    return Record(commit, date, machine, figures, {k: v for k, v in obj.items() if k not in known})


def read_records(path: Path) -> list[Record]:
    """Every record in the file, oldest first; none when the file does not exist yet. Blank lines are skipped."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
        out.append(parse_record(obj, f"{path}:{n}"))
    return out


def record_line(rec: Record) -> str:
    """The record as one JSON line (no trailing newline), the shape ``parse_record`` reads back."""
    figures = []
    for f in rec.figures.values():
        d = asdict(f)
        d["samples"] = list(f.samples)
        figures.append(d)
    obj = {
        "commit": rec.commit,
        "date": rec.date,
        "machine": asdict(rec.machine),
        "figures": figures,
        **rec.extra,
    }
    return json.dumps(obj, sort_keys=False)


def worse_by(fig: Figure, ref: Figure) -> float:
    """How much worse ``fig`` is than ``ref`` (negative: better), in the figure's unit."""
    return fig.value - ref.value if fig.better == "lower" else ref.value - fig.value


def tolerance(fig: Figure, ref: Figure, rel_floor: float = REL_FLOOR) -> float:
    """The change that is not noise: both runs' spreads, the figure's floor, a share of the reference value;
    capped by the regression's size, :data:`REL_CAP` of the reference value (never below the floors)."""
    floors = max(fig.floor, ref.floor, rel_floor * abs(ref.value))
    noise = max(fig.spread, ref.spread, floors)
    return min(noise, max(floors, REL_CAP * abs(ref.value)))


def verdict(fig: Figure, ref: Figure | None, rel_floor: float = REL_FLOOR) -> str:
    if ref is None:
        return "new"
    d, tol = worse_by(fig, ref), tolerance(fig, ref, rel_floor)
    if d > tol:
        return "WORSE"
    if -d > tol:
        return "better"
    return "same"


def best_of(figs: Sequence[Figure]) -> Figure | None:
    if not figs:
        return None
    return min(figs, key=lambda f: f.value) if figs[0].better == "lower" else max(figs, key=lambda f: f.value)


def compare(current: Record, history: Sequence[Record], rel_floor: float = REL_FLOOR) -> list[Row]:
    """Each figure of ``current`` against the records of ``history`` made on a comparable machine."""
    same_box = [r for r in history if r.machine.comparable(current.machine)]
    rows = []
    for name, fig in current.figures.items():
        past = [(r.commit, r.figures[name]) for r in same_box if name in r.figures]
        last = past[-1][1] if past else None
        rows.append(
            Row(
                fig,
                best_of([f for _, f in past]),
                last,
                past[-1][0] if past else None,
                verdict(fig, last, rel_floor),
                tolerance(fig, last, rel_floor) if last else None,
            )
        )
    return rows


def regressions(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.verdict == "WORSE"]


def fmt(v: float) -> str:
    """A figure's value at a useful precision: 3 significant digits, thousands separated."""
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
    return f"{v:.{digits}f}"


def fmt_spread(spread: float, value: float) -> str:
    """A spread at its value's precision (a spread of 0.00005 next to 0.967 reads 0.000)."""
    if abs(value) >= 1000 or value == 0:
        return fmt(spread)
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    return f"{spread:.{digits}f}"


def format_table(rows: Sequence[Row]) -> str:
    """The terminal table: now ± spread, the best and the last on a comparable machine, and the verdict."""
    head = ("figure", "now", "± spread", "unit", "better", "best", "last", "vs last", "verdict")
    body = [
        (
            r.figure.name,
            fmt(r.figure.value),
            fmt_spread(r.figure.spread, r.figure.value),
            r.figure.unit,
            r.figure.better,
            fmt(r.best.value) if r.best else "-",
            fmt(r.last.value) if r.last else "-",
            f"{100 * (r.figure.value - r.last.value) / abs(r.last.value):+.1f} %"
            if r.last and r.last.value
            else "-",
            r.verdict
            + (f" (by more than {fmt(r.tolerance)})" if r.verdict == "WORSE" and r.tolerance else ""),
        )
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    right = {1, 2, 5, 6, 7}
    lines = []
    for row in (head, *body):
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def latest_figures(records: Sequence[Record]) -> list[tuple[Record, Figure]]:
    """Each figure's most recent record, in the order the figures first appear in the file."""
    latest: dict[str, tuple[Record, Figure]] = {}  # insertion order: first appearance
    for rec in records:
        for name, fig in rec.figures.items():
            latest[name] = (rec, fig)
    return list(latest.values())


def staleness(
    rec: Record, now: datetime, commits_since: Callable[[str], int | None], max_commits: int, max_days: float
) -> str:
    """Empty when fresh; else why the figure is stale (older than ``max_commits`` commits or ``max_days`` days)."""
    why = []
    n = commits_since(rec.commit.removesuffix("+dirty"))
    if n is None:
        why.append("commit not in this history")
    elif n > max_commits:
        why.append(f"{n} commits old")
    days = (now - datetime.fromisoformat(rec.date)).total_seconds() / 86400
    if days > max_days:
        why.append(f"{days:.0f} days old")
    return "; ".join(why)


def table_md(
    records: Sequence[Record],
    now: datetime,
    commits_since: Callable[[str], int | None],
    max_commits: int = 50,
    max_days: float = 14,
    reproduce: Callable[[str], str | None] | None = None,
) -> str:
    """The markdown table of each figure's latest recorded value, marking the stale ones; with ``reproduce``
    (a figure's name to the one command that measures it again) a column with that command."""
    if not records:
        return "_No record yet: run `python bench/record.py`._\n"
    how = "reproduce | " if reproduce else ""
    lines = [
        f"| figure | value | ± spread | unit | better | best (same machine) | commit | date (UTC) | {how}|",
        "| --- | ---: | ---: | --- | --- | ---: | --- | --- | " + ("--- | " if reproduce else "") + "--- |",
    ]
    machines: list[str] = []
    loads: dict[str, str] = {}
    for rec, fig in latest_figures(records):
        load = rec.extra.get("load_avg")
        if isinstance(load, list) and len(load) == 2:
            loads[rec.commit.removesuffix("+dirty")[:10] + " " + rec.date[:16].replace("T", " ")] = (
                f"{load[0]:g} → {load[1]:g}"
            )
        same = [
            r.figures[fig.name]
            for r in records
            if fig.name in r.figures and r.machine.comparable(rec.machine)
        ]
        best = best_of(same)
        stale = staleness(rec, now, commits_since, max_commits, max_days)
        if rec.machine.short() not in machines:
            machines.append(rec.machine.short())
        lines.append(
            f"| {fig.name} | {fmt(fig.value)} | {fmt_spread(fig.spread, fig.value)} | {fig.unit} | {fig.better} | "
            f"{fmt(best.value) if best else '-'} | `{rec.commit.removesuffix('+dirty')[:10]}{'+dirty' if rec.commit.endswith('+dirty') else ''}` | "
            f"{rec.date[:16].replace('T', ' ')} | {reproduce_cell(reproduce, fig.name)}"
            f"{'**stale**: ' + stale if stale else ''} |"
        )
    lines.append("")
    lines.append(
        f"Machine: {'; '.join(machines)}. Stale: more than {max_commits} commits or {max_days:g} days old."
    )
    if loads:
        lines.append(
            "Load average at the start → end of each run: "
            + "; ".join(f"{k}: {v}" for k, v in loads.items())
            + " (a load above the core count means the benchmarks waited for a CPU)."
        )
    return "\n".join(lines) + "\n"


def reproduce_cell(reproduce: Callable[[str], str | None] | None, name: str) -> str:
    """The table's reproduce cell for figure ``name`` (with its separator), or nothing without the column."""
    if reproduce is None:
        return ""
    cmd = reproduce(name)
    return f"`{cmd}` | " if cmd else "- | "


def replace_between(text: str, block: str, begin: str, end: str, where: str) -> str:
    """``text`` with what lies between the ``begin`` and ``end`` marker lines replaced by ``block``."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise RecordError(f"{where}: needs the marker lines {begin!r} and then {end!r}")
    return text[: i + len(begin)] + "\n" + block + text[j:]
