"""The typed run protocol (pipeline/run/rundir/protocol.py), the reducer from events to a stage's facts
(stage_reducer.py) and the typed, versioned ``state.json`` snapshot (state_file.py): an unknown event kind is
kept and shown, a NaN metric is kept as NaN, a new attempt starts the facts over, and a snapshot row carries
every row field and its display state."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from pipeline.run.rundir import protocol as p
from pipeline.run.rundir.events import EventWriter, make, parse_lines, read_all
from pipeline.run.rundir.stage_reducer import StageFacts
from pipeline.run.rundir.stage_row import (
    ROW_FIELDS,
    DisplayState,
    HealthState,
    StageRow,
    StageState,
    display_of,
)
from pipeline.run.rundir.state_file import SNAPSHOT_VERSION, SnapshotRow, StateSnapshot


def test_each_kind_decodes_to_its_class_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("started", attempt=2, pid=41)
        w.emit("progress", done=3, total=10, unit="rows", key="a", rejects=1)
        w.emit("metric", name="loss", value=2.5, step=7, label="val")
        w.emit("message", level="warning", text="slow disk", code="paused")
        w.emit("health", state="ready")
        w.emit("finished", status="failed", returncode=3, error="boom")
    evs = p.decode_all(read_all(path))
    started, prog, metric, msg, health, fin = evs
    assert isinstance(started, p.Started) and (started.attempt, started.pid) == (2, 41)
    assert isinstance(prog, p.Progress) and (prog.done, prog.total, prog.unit, prog.key, prog.bad) == (
        3,
        10,
        "rows",
        "a",
        1,
    )
    assert isinstance(metric, p.Metric) and (metric.series, metric.step, metric.value) == ("loss/val", 7, 2.5)
    assert isinstance(msg, p.Message) and (msg.level, msg.code, msg.text) == (
        "warning",
        "paused",
        "slow disk",
    )
    assert isinstance(health, p.Health) and health.state == "ready"
    assert isinstance(fin, p.Finished) and (fin.status, fin.returncode, fin.error) == ("failed", 3, "boom")
    assert [p.kind_of(e) for e in evs] == ["started", "progress", "metric", "message", "health", "finished"]
    assert p.describe(fin) == "finished: failed (rc 3): boom"


def test_an_unknown_kind_is_kept_and_shown_never_dropped() -> None:
    lines = [
        b'{"type":"started","t":1,"attempt":1,"pid":5}',
        b'{"type":"checkpoint","t":2,"path":"/ck/step-100","step":100}',
        b'{"type":"metric","t":3,"name":"loss","value":1.5}',
    ]
    events, bad = parse_lines(lines)
    assert bad == [] and len(events) == 3  # a newer writer's kind is not a bad line
    typed = p.decode_all(events)
    unknown = typed[1]
    assert isinstance(unknown, p.Unknown) and unknown.kind == "checkpoint" and unknown.data["step"] == 100
    shown = p.describe(unknown)
    assert "checkpoint" in shown and "/ck/step-100" in shown and "does not know" in shown
    facts = StageFacts().apply_all(typed)  # the reducer passes over it
    assert facts.attempt == 1 and facts.metrics == {"loss": 1.5}


def test_a_nan_metric_stays_nan_through_the_wire_and_the_reducer(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as w:
        w.emit("metric", name="loss", value=2.3, step=1)
        w.emit("metric", name="loss", value=float("nan"), step=2)
        w.emit("metric", name="grad_norm", value=float("inf"), step=2)
    typed = p.decode_all(read_all(path))
    facts = StageFacts().apply_all(typed)
    assert math.isnan(facts.metrics["loss"]) and facts.metrics["grad_norm"] == math.inf
    assert facts.metric_t == typed[-1].t
    assert [p.describe(e) for e in typed] == ["loss = 2.3", "loss = nan", "grad_norm = inf"]


def test_the_reducer_follows_the_current_attempt() -> None:
    evs = [
        make("started", t=10, attempt=1, pid=1),
        make("progress", t=11, done=5, total=10, unit="steps"),
        make("health", t=11, state="ready"),
        make("message", t=12, level="info", text="paused", code="paused"),
        make("progress", t=11.5, done=6, total=10, unit="steps"),  # the latest in file order, whatever its t
    ]
    facts = StageFacts().apply_all(p.decode_all(evs))
    assert facts.attempt == 1 and facts.health == HealthState.READY and facts.paused_ack_t == 12
    assert facts.progress_row() == {"done": 6, "total": 10, "unit": "steps", "t": 11.5}
    facts.apply(p.decode(make("message", t=14, level="info", text="resumed", code="resumed")))
    assert facts.paused_ack_t == 0
    facts.apply(p.decode(make("started", t=20, attempt=2, pid=2)))  # a retry: nothing of attempt 1 holds
    assert (facts.attempt, facts.health, facts.progress, facts.pid) == (2, None, None, 2)
    facts.apply(p.decode(make("finished", t=30, status="succeeded", returncode=0)))
    assert facts.finished is not None and facts.finished.status == "succeeded"


def test_the_display_state_is_decided_from_fields_never_from_the_reason() -> None:
    row = StageRow(id="train", family="train", state=StageState.RUNNING)
    row.reason = "queued: Slurm job 12 pending (Resources)"  # prose alone says nothing
    assert display_of(row) == DisplayState.RUNNING
    row.queued = True
    assert display_of(row) == DisplayState.STARTING
    row.pausing = True
    assert display_of(row) == DisplayState.PAUSING
    row = StageRow(id="serve", family="serve", state=StageState.RUNNING, service=True)
    row.health = HealthState.UNHEALTHY
    assert display_of(row, starting=True) == DisplayState.UNHEALTHY
    assert display_of(StageRow(id="x", family="x", state="rebalancing")) == "rebalancing"  # a newer word


def test_the_snapshot_is_versioned_and_carries_every_row_field() -> None:
    row = StageRow(id="prep.a", family="prep", state=StageState.RUNNING, queued=True, gpus=[0, 1])
    row.display = display_of(row)
    snap = StateSnapshot(
        run="r", stages=[SnapshotRow(row, {"done": 1, "total": 2, "unit": "rows", "t": 5.0})]
    )
    d = snap.to_dict()
    assert d["version"] == SNAPSHOT_VERSION == 2
    assert set(d["stages"][0]) == {f.name for f in fields(StageRow)} | {"progress"}
    assert d["stages"][0]["display"] == "starting" and d["stages"][0]["queued"] is True
    back = StateSnapshot.from_dict(d)
    assert back.stages[0].row == row and back.stages[0].progress == d["stages"][0]["progress"]
    # a version-1 snapshot (no display field): the state as it is; never the reason's words
    old = StateSnapshot.from_dict(
        {"stages": [{"id": "t", "family": "t", "state": "running", "reason": "starting"}]}
    )
    assert old.version == 1 and old.stages[0].row.display_state == "running"
    assert set(ROW_FIELDS) >= {"retry_at", "pausing", "gpus", "service", "display", "queued"}


def test_a_snapshot_row_without_an_id_is_refused_naming_it() -> None:
    try:
        StateSnapshot.from_dict({"stages": [{"id": "a"}, {"state": "running"}]})
    except ValueError as exc:
        assert "stages[1]" in str(exc)
    else:
        raise AssertionError("a row without an id was accepted")


# ------------------------------------------------------------------------------ real run directories
STATUS_PLAN = """
[run]
name = "rows"
[resources]
cpu_slots = 4
gpus = [0, 1]
[[stage]]
id = "flaky"
command = "exit 3"
retry = {max_attempts = 2, backoff_s = 600}
[[stage]]
id = "svc"
command = "sleep 60"
service = true
gpus = [1]
[[stage]]
id = "work"
command = "sleep 60"
"""


def test_status_json_serialises_every_row_field(tmp_path: Path) -> None:
    """A real supervisor: ``aerie status --json`` prints each stage's whole row — before, a hand list left out
    retry_at, pausing, gpus and service — with its display state, so a script sees what the board sees."""
    import json
    import subprocess
    import sys

    from tests.runs import kill_run_stages, make_run, stage_state, start_supervisor, stop, wait_for

    run = make_run(tmp_path, STATUS_PLAN)
    sup = start_supervisor(run)
    try:
        wait_for(lambda: stage_state(run, "flaky").get("retry_at"), 30, "flaky failed, its retry scheduled")
        for sid in ("svc", "work"):  # launched, then its process reported (display: starting, then running)
            wait_for(lambda sid=sid: stage_state(run, sid).get("display") == "running", 30, f"{sid} running")
        out = subprocess.run(
            [sys.executable, "-m", "console.cli", "status", str(run.root), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    finally:
        stop(sup)
        kill_run_stages(run)
    rows = {d["id"]: d for d in map(json.loads, out) if "id" in d}
    every = set(ROW_FIELDS) | {"progress"}
    assert set(rows["flaky"]) == every and set(rows["svc"]) == every
    assert rows["flaky"]["state"] == "failed" and rows["flaky"]["retry_at"] > rows["flaky"]["finished_at"]
    assert rows["flaky"]["display"] == "failed" and rows["flaky"]["pausing"] is False
    assert rows["svc"]["service"] is True and rows["svc"]["gpus"] == [1]
    assert rows["svc"]["display"] == "running" and rows["work"]["display"] == "running"


async def test_the_board_shows_starting_from_the_snapshots_field(tmp_path: Path) -> None:
    """A local stage launched whose launcher has not reported its process yet: the supervisor's snapshot says
    ``display: starting`` and the console's board shows it from that field (the reason is no longer read);
    ``aerie status`` prints that display state too, not the raw ``running``."""
    import time

    from console.model import RunModel
    from console.transport import LocalTransport
    from pipeline.run.rundir.layout import read_json, write_json
    from pipeline.run.supervise.supervisor import Supervisor
    from tests.runs import make_run

    run = make_run(tmp_path, STATUS_PLAN)
    write_json(run.stage("flaky").launch, {"attempt": 1, "t": time.time()})  # launched, no proc.json yet
    sup = Supervisor(run)
    sup.refresh()
    sup.write_state(force=True)
    row = next(r for r in (read_json(run.state_path) or {})["stages"] if r["id"] == "flaky")
    assert (row["state"], row["display"]) == ("running", "starting")
    model = RunModel(LocalTransport(str(run.root)), backfill=False)
    await model.poll()
    st = model.stages["flaky"]
    assert st.display_state == "starting"
    st.reason = "anything at all"  # prose changes nothing: the field decides
    assert st.display_state == "starting"
    assert model.stages["svc"].display_state == "ready"  # a stage whose turn has come, not started
    import subprocess
    import sys

    status = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {ln.split()[0]: ln.split()[1] for ln in status.stdout.splitlines() if ln.startswith("flaky ")}
    assert rows == {"flaky": "starting"}, status.stdout + status.stderr  # as the board says, not "running"


async def test_the_console_lists_an_unknown_kind_as_written(tmp_path: Path) -> None:
    """A newer stage writes a kind this console does not know: its event list (the detail pane) shows it."""
    import json

    from console.model import RunModel
    from console.transport import LocalTransport
    from pipeline.run.rundir.protocol import describe as describe_event

    row = {"id": "train", "family": "train", "state": "running", "attempt": 1}
    (tmp_path / "state.json").write_text(json.dumps({"run": "r", "executor": "local", "stages": [row]}))
    events = tmp_path / "stages" / "train" / "events.jsonl"
    events.parent.mkdir(parents=True)
    events.write_text(
        '{"type":"started","t":1,"attempt":1,"pid":5}\n'
        '{"type":"checkpoint","t":2,"path":"/ck/step-100"}\n'
        '{"type":"metric","t":3,"name":"loss","value":1.5,"step":100}\n'
    )
    model = RunModel(LocalTransport(str(tmp_path)), backfill=False)
    for _ in range(2):  # the stage appears, then its events are read
        await model.poll()
    shown = [describe_event(e) for e in model.stages["train"].events]
    assert len(shown) == 3 and "checkpoint" in shown[1] and "/ck/step-100" in shown[1], shown
    assert shown[2] == "loss = 1.5" and model.stages["train"].metrics == {"loss": 1.5}
