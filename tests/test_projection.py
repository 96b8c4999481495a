"""The run projection (pipeline/run/projection/compute.py): a run with known rates, its finish, remaining time and
GPU-hours; parallel branches, a stage not started estimated from the plan's sizes, a failed stage, a paused
one, a server; and ``aerie status --json`` on a real run directory carrying it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.run.plan import dag as plan_mod
from pipeline.run.projection.compute import DEFAULT_RATES, DiskNow, StageProgress, project
from pipeline.run.projection.text import compact_line, status_lines

NOW = 1_800_000_000.0
# Two datasets prepared in parallel (a: 1,000 rows, b: 4,000), then training on GPUs 0-1, then a bench on GPU 0.
PLAN = """
[run]
name = "eta"
dir = "run"
[resources]
cpu_slots = 8
gpus = [0, 1, 2, 3]
[train]
steps = 1000
[bench]
prompts = 100
[[datasets]]
name = "a"
source = "x"
kind = "target-native"
quota = 1000
[[datasets]]
name = "b"
source = "x"
kind = "target-native"
quota = 4000
[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"
[[stage]]
id = "train"
run = "train"
after = ["prep.*"]
gpus = [0, 1]
[[stage]]
id = "bench"
run = "bench"
after = ["train"]
gpus = [0]
"""
TRAIN_S = 1000 / DEFAULT_RATES["train"][0]  # 1,000 steps at the assumed rate
BENCH_S = 100 / DEFAULT_RATES["bench"][0]


@pytest.fixture
def plan(tmp_path: Path) -> plan_mod.Plan:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN)
    return plan_mod.load(path)


def running(done: float, total: float, unit: str, started: float, rate: float | None = None) -> StageProgress:
    return StageProgress("running", started, None, done, total, unit, NOW, rate)


def by_id(p, sid: str):  # noqa: ANN001, ANN201
    return next(e for e in p.stages if e.id == sid)


def test_two_branches_in_parallel_finish_with_the_longer_one(plan: plan_mod.Plan) -> None:
    p = project(
        plan,
        {
            "prep.a": running(500, 1000, "rows", NOW - 50, rate=10.0),  # 50 s left
            "prep.b": running(1000, 4000, "rows", NOW - 100, rate=10.0),  # 300 s left: the critical path
        },
        NOW,
    )
    assert by_id(p, "prep.a").end == pytest.approx(NOW + 50)
    assert by_id(p, "train").start == pytest.approx(NOW + 300), "train waits for the longer branch"
    assert p.finish_at == pytest.approx(NOW + 300 + TRAIN_S + BENCH_S)
    assert p.remaining_s == pytest.approx(300 + TRAIN_S + BENCH_S)
    # Nothing that holds a GPU has run; to come: train's 2 GPUs and bench's 1 for their assumed times.
    assert p.gpu_hours_used == 0
    assert p.gpu_hours_projected == pytest.approx((2 * TRAIN_S + BENCH_S) / 3600)
    assert (by_id(p, "train").basis, by_id(p, "train").rate_from) == ("assumed", "default")
    assert p.assumed == ["train", "bench"] and not p.blocked and p.will_finish
    # Progress is the share of the estimated wall time of the work already spent.
    spent, left = 50 + 100, 50 + 300 + TRAIN_S + BENCH_S
    assert p.progress == pytest.approx(spent / (spent + left))


def test_a_stage_not_started_takes_the_rate_its_kind_measured_and_gpu_hours_count_wall_time(
    plan: plan_mod.Plan,
) -> None:
    p = project(
        plan,
        {
            # prep.a took 100 s for its 1,000 rows: 10 rows/s, measured.
            "prep.a": StageProgress("succeeded", NOW - 300, NOW - 200, 1000, 1000, "rows", NOW - 200),
            "prep.b": StageProgress("pending"),  # not started: 4,000 rows (its quota) at prep.a's 10 rows/s
        },
        NOW,
    )
    b = by_id(p, "prep.b")
    assert (b.basis, b.size, b.unit, b.rate, b.rate_from) == ("measured", 4000, "rows", 10.0, "by prep.a")
    assert b.end == pytest.approx(NOW + 400)
    assert p.finish_at == pytest.approx(NOW + 400 + TRAIN_S + BENCH_S)

    # Training is running with its own progress: 200 of 1,000 steps in 100 s (2 steps/s, since its start).
    p = project(
        plan,
        {
            "prep.a": StageProgress("succeeded", NOW - 300, NOW - 200, 1000, 1000, "rows", NOW - 200),
            "prep.b": StageProgress("succeeded", NOW - 300, NOW - 100, 4000, 4000, "rows", NOW - 100),
            "train": running(200, 1000, "steps", NOW - 100),
        },
        NOW,
    )
    t = by_id(p, "train")
    assert (t.basis, t.rate, t.remaining_s) == ("measured", pytest.approx(2.0), pytest.approx(400))
    assert p.finish_at == pytest.approx(NOW + 400 + BENCH_S)
    assert p.gpu_hours_used == pytest.approx(100 * 2 / 3600), "100 s on 2 GPUs"
    assert p.gpu_hours_projected == pytest.approx((100 * 2 + 400 * 2 + BENCH_S) / 3600)
    assert p.stages_done == 2 and p.assumed == ["bench"]


def test_a_failed_stage_means_no_finish_without_a_retry(plan: plan_mod.Plan) -> None:
    failed = StageProgress(
        "failed", NOW - 150, NOW - 50, 1000, 4000, "rows", NOW - 50
    )  # 10 rows/s, 3,000 left
    prog = {"prep.a": StageProgress("succeeded", NOW - 300, NOW - 200, 1000, 1000, "rows", NOW - 200)}
    p = project(plan, {**prog, "prep.b": failed, "train": StageProgress("upstream-failed")}, NOW)
    assert p.blocked == ["prep.b"] and not p.will_finish
    # The times are those of a retry started now, resuming where the attempt stopped.
    assert p.finish_at == pytest.approx(NOW + 300 + TRAIN_S + BENCH_S)
    line = compact_line(p)
    assert "won't finish: retry prep.b" in line and len(line) <= 80
    assert any("will not finish without a retry of prep.b" in ln for ln in status_lines(p))

    # An automatic retry already scheduled in a minute: the run will finish, a minute later.
    scheduled = StageProgress("failed", NOW - 150, NOW - 50, 1000, 4000, "rows", NOW - 50, retry_at=NOW + 60)
    p = project(plan, {**prog, "prep.b": scheduled}, NOW)
    assert p.will_finish and p.finish_at == pytest.approx(NOW + 60 + 300 + TRAIN_S + BENCH_S)


def test_a_paused_stage_moves_the_finish_later_and_keeps_counting_its_gpus(plan: plan_mod.Plan) -> None:
    prog = {
        "prep.a": StageProgress("succeeded", NOW - 900, NOW - 800, 1000, 1000, "rows", NOW - 800),
        "prep.b": StageProgress("succeeded", NOW - 900, NOW - 700, 4000, 4000, "rows", NOW - 700),
    }
    paused = StageProgress("paused", NOW - 500, None, 500, 1000, "steps", NOW - 250, rate=2.0)
    p = project(plan, {**prog, "train": paused}, NOW)
    assert p.paused == ["train"]
    assert p.finish_at == pytest.approx(NOW + 250 + BENCH_S), "as if resumed now: 500 steps at 2 steps/s"
    later = project(plan, {**prog, "train": paused}, NOW + 100)
    assert later.finish_at == pytest.approx(p.finish_at + 100), "still paused 100 s later: 100 s later"
    assert later.gpu_hours_used - p.gpu_hours_used == pytest.approx(100 * 2 / 3600), (
        "a paused stage holds its GPUs"
    )
    assert "later while train paused" in compact_line(p)


def test_a_server_runs_until_its_last_user_ends_and_what_is_after_it_waits(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(
        PLAN.replace('kind = "target-native"\nquota = 4000', 'kind = "prompt-only"\nquota = 4000')
        + '[[stage]]\nid = "serve"\nrun = "serve"\nservice = true\ngpus = [2, 3]\n'
        + '[[stage]]\nid = "regen"\nrun = "regen"\nfor_each = "dataset"\nwhen = {kind = "prompt-only"}\n'
        + 'after = ["prep.{dataset}"]\nuses = ["serve"]\ncpu = 0\n'
        + '[[stage]]\nid = "copy"\ncommand = "true"\nafter = ["serve"]\n'
    )
    plan = plan_mod.load(path)
    prog = {
        "prep.a": StageProgress("succeeded", NOW - 300, NOW - 200, 1000, 1000, "rows", NOW - 200),
        "prep.b": StageProgress("succeeded", NOW - 300, NOW - 200, 4000, 4000, "rows", NOW - 200),
        "serve": StageProgress("running", NOW - 100),
        "regen.b": running(1000, 4000, "records", NOW - 100, rate=10.0),  # 300 s left
    }
    p = project(plan, prog, NOW)
    assert by_id(p, "serve").end == pytest.approx(NOW + 300), "the server stops when regen.b ends"
    assert by_id(p, "copy").start == pytest.approx(NOW + 300) and p.unknown == ["copy"]
    assert p.gpu_hours_used == pytest.approx(100 * 2 / 3600)
    # copy (a command of no size) has still to run: the finish is unknown, and so what the run will use
    assert p.unknown_open == ["copy"] and p.gpu_hours_projected is None
    prog["copy"] = StageProgress("skipped")  # nothing of unknown size left to run: the figure again
    p = project(plan, prog, NOW)
    assert p.gpu_hours_projected == pytest.approx((100 * 2 + 300 * 2 + 2 * TRAIN_S + BENCH_S) / 3600)


def test_a_finished_run_and_its_disk_at_finish(plan: plan_mod.Plan) -> None:
    prog = {
        "prep.a": StageProgress("succeeded", NOW - 900, NOW - 800, 1000, 1000, "rows", NOW - 800),
        "prep.b": StageProgress("succeeded", NOW - 900, NOW - 700, 4000, 4000, "rows", NOW - 700),
        "train": StageProgress("succeeded", NOW - 700, NOW - 340, 1000, 1000, "steps", NOW - 340),
        "bench": StageProgress("succeeded", NOW - 340, NOW - 100, 100, 100, "prompts", NOW - 340),
    }
    p = project(plan, prog, NOW, DiskNow(used=3 << 40, total=8 << 40, to_write=0))
    assert p.finished and p.will_finish and p.progress == 1.0 and p.remaining_s == 0
    assert p.finish_at == NOW - 100 and p.started_at == NOW - 900
    assert p.gpu_hours_used == p.gpu_hours_projected == pytest.approx((360 * 2 + 240) / 3600)
    assert compact_line(p) == "100% 4/4 · ended, took 13m · 0.3 GPU-h · disk at end: 38% used, 5.0 TiB free"
    # Before the end, disk at finish is what is used now plus what the stages have still to write.
    p = project(plan, {}, NOW, DiskNow(used=1 << 40, total=8 << 40, to_write=2 << 40))
    assert p.disk_at_finish == 3 << 40 and p.disk_free_at_finish == 5 << 40
    # In df's terms, as the meter: 28.7 GiB used and 77.7 GiB available on a 264 GiB thin disk, 6 GiB to
    # write: 34.7 / 106.4 = 32.6 %, df rounds up; the free space is the meter's "free" less what is written.
    gib = 1 << 30
    p = project(plan, {}, NOW, DiskNow(int(28.7 * gib), 264 * gib, 6 * gib, "/", avail=int(77.7 * gib)))
    assert "disk at end on /: 33% used, 71.7 GiB free" in compact_line(p, 200), compact_line(p, 200)
    assert "disk at finish, as df counts: 33% used, 71.7 GiB free of 264.0 GiB on /" in status_lines(p)
    p = project(plan, {}, NOW, DiskNow(int(28.7 * gib), 264 * gib, 80 * gib, "/", avail=int(77.7 * gib)))
    assert "disk 2.3 GiB short at end on /" in compact_line(p, 200), compact_line(p, 200)


def test_the_compact_line_fits_80_columns_dropping_whole_facts(plan: plan_mod.Plan) -> None:
    p = project(
        plan, {"prep.a": running(500, 1000, "rows", NOW - 50, rate=10.0)}, NOW, DiskNow(1 << 40, 8 << 40, 0)
    )
    full = compact_line(p, 200)
    assert full.startswith("3% 0/4 · finish ") and "GPU-h" in full and "disk" in full and "assumed" in full
    for width in (80, 60, 40):
        line = compact_line(p, width)
        assert len(line) <= width and full.startswith(line), "the least important facts go first, whole"


def test_aerie_status_json_carries_the_projection(tmp_path: Path) -> None:
    """A real run directory (files as launchers write them, state.json by the real supervisor): the last line of
    ``aerie status --json`` is the projection, and the text says the run needs a retry."""
    from pipeline.run.supervise.supervisor import Supervisor
    from tests.runs import finished_run

    run = finished_run(tmp_path / "r")  # 10 preps (one failed, one killed), train and bench upstream-failed
    sup = Supervisor(run)
    sup.refresh()
    sup.write_state(force=True)
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    lines = [json.loads(line) for line in out]  # a line per stage, the projection, the alerts, the audit log
    stages = [d for d in lines if "id" in d]
    (proj,) = [d["projection"] for d in lines if "projection" in d]
    assert list(lines[-1]) == ["audit"] and "projection" in lines[-4]
    assert lines[-3] == {"alerts": []} and lines[-2] == {"anomalies": []}, "no alert was raised in this run"
    assert len(stages) == 12
    assert proj["blocked"] == ["prep.sharegpt", "prep.codefeedback"] and proj["will_finish"] is False
    assert proj["stages_done"] == 8 and proj["stages_total"] == 12 and proj["disk_at_finish"] > 0
    text = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run.root)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "will not finish without a retry of prep.sharegpt, prep.codefeedback" in text


COMMANDS = """
[run]
name = "shell"
dir = "run"
[[stage]]
id = "fetch"
command = "true"
[[stage]]
id = "convert"
command = "true"
after = ["fetch"]
[[stage]]
id = "upload"
command = "true"
after = ["convert"]
"""


def test_stages_of_unknown_size_make_the_finish_unknown_never_finish_now(tmp_path: Path) -> None:
    """Operator shell commands: the plan gives no size. Before the fix: "100% 0/3 · finish now (0s left)"."""
    path = tmp_path / "plan.toml"
    path.write_text(COMMANDS)
    plan = plan_mod.load(path)
    fetch_running = {"fetch": StageProgress("running", NOW - 60)}
    p = project(plan, fetch_running, NOW)
    assert p.progress is None and p.unknown_open == ["fetch", "convert", "upload"] and not p.finish_known
    line = compact_line(p, 200)
    assert line.startswith("0/3 stages · finish unknown: fetch +2 report no size"), line
    assert "finish now" not in line and "100%" not in line
    text = "\n".join(status_lines(p))
    assert "run: progress unknown (fetch, convert, upload: no size known), 0/3 stages done" in text
    assert "finish: unknown" in text

    # A command that reports progress with a total (StageContext.progress): measured by its own rate; the
    # windowed rate of a stage silent for a while is 0, and then the average since its start is used.
    prog = {"fetch": StageProgress("running", NOW - 60, None, 1, 10, "files", NOW - 30, rate=0.0)}
    p = project(plan, prog, NOW)
    fetch = by_id(p, "fetch")
    assert fetch.basis == "measured" and fetch.rate == pytest.approx(1 / 30)
    assert fetch.remaining_s == pytest.approx(9 * 30)
    assert p.unknown_open == ["convert", "upload"] and p.progress is None, "the others still say nothing"

    # All done but one that reports: a finish from its own rate.
    done = StageProgress("succeeded", NOW - 600, NOW - 300)
    prog = {
        "fetch": done,
        "convert": done,
        "upload": StageProgress("running", NOW - 60, None, 5, 10, "x", NOW),
    }
    p = project(plan, prog, NOW)
    assert p.finish_known and p.progress is not None and 0 < p.progress < 1
    assert p.remaining_s == pytest.approx(60) and "finish " in compact_line(p) and "left)" in compact_line(p)


def test_the_disk_at_finish_names_its_filesystem(plan: plan_mod.Plan) -> None:
    p = project(
        plan, {}, NOW, DiskNow(used=1 << 40, total=8 << 40, to_write=2 << 40, mount="/data (/dev/sdb1)")
    )
    assert p.disk_mount == "/data (/dev/sdb1)"
    assert "disk at end on /data: 38% used, 5.0 TiB free" in compact_line(p, 200)
    assert (
        "disk at finish, as df counts: 38% used, 5.0 TiB free of 8.0 TiB on /data (/dev/sdb1)"
        in status_lines(p)
    )
    from pipeline.run.projection.compute import RunProjection

    old = p.to_dict()
    del old["disk_mount"], old["unknown_open"]  # from a host whose Aerie predates them
    assert RunProjection.from_dict(old).disk_mount is None


MIXED = """
[run]
name = "mixed"
dir = "run"
[resources]
cpu_slots = 4
gpus = [0]
[[datasets]]
name = "a"
source = "x"
kind = "target-native"
quota = 1000
[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"
[[stage]]
id = "a"
command = "true"
gpus = [0]
[[stage]]
id = "b"
command = "true"
"""


@pytest.fixture
def mixed(tmp_path: Path) -> plan_mod.Plan:
    path = tmp_path / "plan.toml"
    path.write_text(MIXED)
    return plan_mod.load(path)


def test_a_failure_never_hides_a_stage_of_unknown_size(mixed: plan_mod.Plan) -> None:
    """Before the fix, once a stage had failed the size-less ones were ignored: "100% 1/2 · won't finish:
    retry b" and "5s more if retried now" while the commands ran on."""
    done = StageProgress("succeeded", NOW - 600, NOW - 300)
    # a size-less command failed, the rest done: how long its retry takes nobody knows
    p = project(mixed, {"prep.a": done, "a": done, "b": StageProgress("failed", NOW - 200, NOW - 100)}, NOW)
    line = compact_line(p, 200)
    assert line.startswith("2/3 stages · finish unknown: retry b; b reports no size"), line
    assert "100%" not in line and "more if retried now" not in line and p.gpu_hours_projected is None
    # a sized stage failed while a size-less command is still running: the finish is unknown, not "retry prep.a"
    failed = StageProgress("failed", NOW - 200, NOW - 100, 400, 1000, "rows", NOW - 100)
    p = project(mixed, {"prep.a": failed, "a": StageProgress("running", NOW - 36), "b": done}, NOW)
    line = compact_line(p, 200)
    assert "finish unknown: retry prep.a; a reports no size" in line and "more if retried now" not in line, (
        line
    )
    text = "\n".join(status_lines(p))
    assert "finish: unknown — will not finish without a retry of prep.a; a reports no progress" in text, text
    # its GPU-hours: what was used is known, what the run will use is not (the finish is unknown)
    assert "0.0/? GPU-h" in line
    assert "GPU-hours: 0.01 used, projected unknown (the finish is)" in text
    # once the command reports its size, a failure alone says "won't finish" with the retry's time again
    a = StageProgress("running", NOW - 36, None, 1, 2, "files", NOW)
    line = compact_line(project(mixed, {"prep.a": failed, "a": a, "b": done}, NOW), 200)
    assert "won't finish: retry prep.a" in line and "more if retried now" in line, line


def test_a_stalled_stage_does_not_keep_its_last_rate(mixed: plan_mod.Plan) -> None:
    """A command reported 1/10 a second after its start, then nothing: before the fix "9s left" for good."""
    started = NOW - 900
    stalled = StageProgress("running", started, None, 1, 10, "files", started + 1)
    done = StageProgress("succeeded", NOW - 600, NOW - 300)

    def left(now: float, p: StageProgress = stalled) -> float:
        return by_id(project(mixed, {"prep.a": done, "a": p, "b": done}, now), "a").remaining_s

    assert left(started + 30) == pytest.approx(9.0), "a stage reporting on time keeps its rate"
    assert left(NOW) > 3600, "silent for 15 minutes: its rate has decayed"
    assert left(NOW + 3600) > left(NOW), "and goes on decaying while it stays silent"
    line = compact_line(project(mixed, {"prep.a": done, "a": stalled, "b": done}, NOW), 200)
    assert "(9s left)" not in line and "left)" in line, line
    # the console's windowed rate decays the same way
    windowed = StageProgress("running", started, None, 1, 10, "files", started + 1, rate=1.0)
    assert left(started + 30, windowed) == pytest.approx(9.0)
    assert left(NOW, windowed) > 60 and left(NOW + 3600, windowed) > left(NOW, windowed)


def test_the_boards_eta_of_a_stalled_stage_grows_while_it_stays_silent() -> None:
    """The board's Rate and ETA columns (console.model.Progress): 1/10 a second after its start, then silence."""
    from console.model import Progress

    p = Progress()
    p.add(NOW - 900, 0, 10, "files")
    p.add(NOW - 899, 1, 10, "files")
    assert p.eta_s(NOW - 899 + 30) == pytest.approx(9.0), "on time: its measured rate"
    assert p.eta_s(NOW) > 3600 and p.eta_s(NOW + 3600) > p.eta_s(NOW), "silent: the ETA grows with wall time"
