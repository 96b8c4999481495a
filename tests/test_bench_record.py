"""The benchmark record (bench/record.py, bench/record_store.py): reading record files, flagging what got worse
against the last run on a comparable machine, the markdown table's stale marks, and one real run of the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench import record_store as rs
from bench.record import machine
from bench.record import main as record_main
from tests.runs import ROOT

BOX = {"hostname": "vm", "cpu": "AMD EPYC", "cores": 2, "python": "3.11.7", "torch": "2.13.0+cpu"}


def line(commit: str, figures: list[dict], box: dict = BOX, date: str = "2026-12-04T10:00:00+00:00") -> str:
    return json.dumps({"commit": commit, "date": date, "machine": box, "figures": figures, "repeats": 2})


def fig(
    name: str, value: float, spread: float, better: str = "lower", unit: str = "ms", floor: float = 0.0
) -> dict:
    return {"name": name, "value": value, "unit": unit, "better": better, "spread": spread, "floor": floor}


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(ln + "\n" for ln in lines))
    return path


def run_of(*figures: rs.Figure, box: dict = BOX) -> rs.Record:
    return rs.Record("c", "2026-12-04T12:00:00+00:00", rs.Machine(**box), {f.name: f for f in figures})


def test_a_malformed_line_names_the_file_and_its_line(tmp_path: Path) -> None:
    rec = write(tmp_path / "record.jsonl", line("a", [fig("x", 1, 0.1)]), "", '{"commit": "b", "date": ')
    with pytest.raises(rs.RecordError, match=rf"^{tmp_path}/record.jsonl:3: not JSON"):
        rs.read_records(rec)
    write(
        rec, line("a", [fig("x", 1, 0.1)]), line("b", [{"name": "y", "value": 2, "unit": "ms", "spread": 0}])
    )
    with pytest.raises(rs.RecordError, match=r"record.jsonl:2: figure 'y': missing field 'better'"):
        rs.read_records(rec)
    write(rec, json.dumps({"commit": "a", "date": "yesterday", "machine": BOX, "figures": []}))
    with pytest.raises(rs.RecordError, match=r"record.jsonl:1: field 'date' is not an ISO date"):
        rs.read_records(rec)
    write(rec, line("a", [fig("x", 1, 0.1)], box={**BOX, "cores": "2"}))
    with pytest.raises(rs.RecordError, match=r"record.jsonl:1: machine: field 'cores' is str, not int"):
        rs.read_records(rec)
    assert rs.read_records(tmp_path / "none-yet.jsonl") == []


def test_a_written_record_reads_back_with_median_and_spread(tmp_path: Path) -> None:
    f = rs.figure_from_samples("prep_rows_per_s", "rows/s", "higher", [400, 380, 430])
    assert (f.value, f.spread, f.samples) == (400, 50, (400.0, 380.0, 430.0))
    rec = rs.Record("abc+dirty", "2026-12-04T12:00:00+00:00", rs.Machine(**BOX), {f.name: f}, {"repeats": 3})
    path = write(tmp_path / "r.jsonl", rs.record_line(rec), rs.record_line(rec))
    assert rs.read_records(path) == [rec, rec]
    with pytest.raises(rs.RecordError, match="finite"):
        rs.figure_from_samples("x", "ms", "lower", [1.0, float("nan")])


def test_worse_better_and_within_spread_against_the_last_run(tmp_path: Path) -> None:
    history = rs.read_records(
        write(
            tmp_path / "r.jsonl",
            line("old", [fig("render_ms", 8.0, 0.2), fig("rows_per_s", 500, 10, better="higher")]),
            line("last", [fig("render_ms", 10.0, 0.2), fig("rows_per_s", 400, 10, better="higher")]),
        )
    )
    cases = {
        # lower is better: last was 10.0 ± 0.2; 5 % of it (0.5) is the floor unless a spread is larger
        (11.0, 0.3, "lower"): "WORSE",
        (10.4, 0.3, "lower"): "same",  # within the 5 % floor
        (11.0, 1.5, "lower"): "same",  # within this run's own spread
        (16.0, 7.0, "lower"): "WORSE",  # worse by 60 %: more than half its own value, whatever the spread
        (4.0, 7.0, "lower"): "better",  # the same cap the other way
        (9.0, 0.3, "lower"): "better",
        # higher is better: last was 400 ± 10
        (300.0, 10, "higher"): "WORSE",
        (390.0, 5, "higher"): "same",
        (450.0, 5, "higher"): "better",
    }
    for (value, spread, better), want in cases.items():
        name = "render_ms" if better == "lower" else "rows_per_s"
        f = rs.Figure(name, value, "x", better, spread)
        (row,) = rs.compare(run_of(f), history)
        assert row.verdict == want, (value, spread, better, row)
        assert row.last is not None and row.last_commit == "last"
        assert row.best is not None and row.best.value == (8.0 if better == "lower" else 500)
    worse = rs.compare(run_of(rs.Figure("render_ms", 11.0, "ms", "lower", 0.3)), history)
    assert [r.figure.name for r in rs.regressions(worse)] == ["render_ms"]
    table = rs.format_table(worse)
    assert "WORSE (by more than 0.500)" in table and "+10.0 %" in table
    # The case: a loaded run's 20.8 ms ± 21.2 against a recorded 0.001 ms is WORSE, not "same".
    tiny = rs.read_records(write(tmp_path / "t.jsonl", line("t", [fig("plot_detail_ms", 0.001, 0.0)])))
    (row,) = rs.compare(run_of(rs.Figure("plot_detail_ms", 20.8, "ms", "lower", 21.2)), tiny)
    assert row.verdict == "WORSE"
    # A figure's own floor (a clock tick) wins over a spread of zero.
    ticks = rs.compare(run_of(rs.Figure("render_ms", 10.9, "ms", "lower", 0.0, floor=1.0)), history)
    assert ticks[0].verdict == "same"


def test_another_machine_is_not_compared(tmp_path: Path) -> None:
    history = rs.read_records(
        write(
            tmp_path / "r.jsonl",
            line("fast-box", [fig("render_ms", 1.0, 0.1)], box={**BOX, "cpu": "Intel Xeon Platinum 8480+"}),
            line("more-cores", [fig("render_ms", 1.0, 0.1)], box={**BOX, "cores": 16}),
        )
    )
    (row,) = rs.compare(run_of(rs.Figure("render_ms", 10.0, "ms", "lower", 0.1)), history)
    assert (row.verdict, row.best, row.last) == ("new", None, None)
    other_host = rs.Machine(**{**BOX, "hostname": "vm2", "python": "3.12.1"})
    assert other_host.comparable(rs.Machine(**BOX))  # same CPU model and cores: comparable


def test_the_markdown_table_marks_stale_figures(tmp_path: Path) -> None:
    now = datetime(2026, 12, 4, 12, tzinfo=UTC)
    old = (now - timedelta(days=30)).isoformat()
    records = rs.read_records(
        write(
            tmp_path / "r.jsonl",
            line("aaaa", [fig("render_ms", 9.0, 0.2), fig("demo_wall_s", 300, 20)], date=old),
            line("bbbb", [fig("render_ms", 8.0, 0.2)], date=now.isoformat()),
            line("cccc+dirty", [fig("rows_per_s", 400, 10, better="higher")], date=now.isoformat()),
        )
    )
    behind = {"aaaa": 80, "bbbb": 3}  # commits since each; cccc is not in this history
    md = rs.table_md(records, now, behind.get, max_commits=50, max_days=14)
    rows = {r.split("|")[1].strip(): r for r in md.splitlines() if r.startswith("| ") and "---" not in r}
    assert "**stale**" not in rows["render_ms"] and "| 8.00 |" in rows["render_ms"]  # the latest value, fresh
    assert "**stale**: 80 commits old; 30 days old" in rows["demo_wall_s"]
    assert (
        "**stale**: commit not in this history" in rows["rows_per_s"] and "`cccc+dirty`" in rows["rows_per_s"]
    )
    assert "2 cores, AMD EPYC" in md
    assert rs.table_md([], now, behind.get).startswith("_No record yet")


def test_the_table_replaces_only_what_lies_between_its_markers() -> None:
    doc = "# Performance\n\n<!-- b -->\nold table\n<!-- e -->\n\n## Notes\n"
    assert rs.replace_between(doc, "new\n", "<!-- b -->", "<!-- e -->", "perf.md") == (
        "# Performance\n\n<!-- b -->\nnew\n<!-- e -->\n\n## Notes\n"
    )
    with pytest.raises(rs.RecordError, match="perf.md: needs the marker lines"):
        rs.replace_between("# no markers\n", "x", "<!-- b -->", "<!-- e -->", "perf.md")


def test_record_runs_a_benchmark_twice_appends_a_line_and_flags_a_regression(tmp_path: Path) -> None:
    """The real command on the cheapest benchmark. The prior line claims an impossible 1 µs a plot build on this
    very machine, so today's figure must come out WORSE and --fail-on-worse must exit 1."""
    box = machine()
    record = write(
        tmp_path / "record.jsonl",
        line(
            "0" * 40, [fig("plot_detail_ms", 0.001, 0.0)], box=box.__dict__, date="2026-12-01T00:00:00+00:00"
        ),
    )
    cmd = [
        sys.executable,
        "bench/record.py",
        "--only",
        "plot_render",
        "--repeats",
        "2",
        "--record",
        str(record),
    ]
    p = subprocess.run(
        [*cmd, "--fail-on-worse"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "WORSE: plot_detail_ms" in p.stdout
    first, new = rs.read_records(record)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert new.commit.removesuffix("+dirty") == head
    assert datetime.fromisoformat(new.date).tzinfo is not None
    assert new.machine == box and new.machine.cores == os.cpu_count()
    assert set(new.figures) == {"plot_detail_ms", "plot_metrics_ms"}
    for f in new.figures.values():
        assert (f.unit, f.better, len(f.samples)) == ("ms", "lower", 2)
        assert f.value > 0 and f.spread == max(f.samples) - min(f.samples)
    assert new.extra["benchmarks"] == ["plot_render"] and new.extra["repeats"] == 2
    with pytest.raises(SystemExit, match="--only: unknown benchmark nope; known: console,"):
        record_main(["--only", "nope", "--record", str(record)])


def test_the_docs_table_holds_the_records_latest_figures() -> None:
    """docs/performance.md opens with the record's table: generated from bench/record.jsonl, not typed by hand."""
    from bench.record import BEGIN, DOCS, END, RECORD

    doc = DOCS.read_text()
    assert BEGIN in doc and END in doc, "docs/performance.md lost the record's table markers"
    block = doc.split(BEGIN, 1)[1].split(END, 1)[0]
    shown = {
        cells[1].strip(): cells[2].strip()
        for cells in (row.split("|") for row in block.splitlines())
        if len(cells) > 3 and cells[1].strip() not in ("figure", "---")
    }
    latest = {f.name: rs.fmt(f.value) for _, f in rs.latest_figures(rs.read_records(RECORD))}
    assert shown == latest, "run: python bench/record.py --table-md --write-docs"
