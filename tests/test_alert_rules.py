"""Alert rules on the executing host (pipeline/run/alerts/): each rule fires once with its evidence on a bad
sequence, stays quiet on a healthy one, and re-arms once its condition clears. The metric events are written by
the stages' own writers (``StageContext``, the serve stage's ``LogFollower`` on SGLang log lines, the telemetry
agent on the FAKE NVML replaying the H200 recording) and read back by the supervisor's ``RunWatcher``, which
records each episode in ``RUN/alerts.jsonl``; the console shows those records."""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from console.app import AerieApp
from console.screens.alerts import AlertsScreen
from console.settings import resolve
from console.transport import LocalTransport
from console.widgets.board import StageBoard
from pipeline.run.alerts import record
from pipeline.run.alerts.record import AlertRecord as Alert
from pipeline.run.alerts.watcher import RunWatcher, for_plan
from pipeline.run.hosts.gpus import FakeNvmlReplay
from pipeline.run.plan.sections import AlertsSection
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.stage_row import StageRow
from pipeline.run.stage_side.runtime import StageContext
from pipeline.serving.sglang_log import ServerStats
from pipeline.stages.serve import stage as serve_stage
from pipeline.stages.telemetry import Agent
from tests.runs import kill_run_stages, make_run, start_supervisor, stop, wait_for
from tests.screen_text import svg_rows
from tests.test_console import until

T0 = float(int(time.time()) - 3600)  # stages start an hour ago (metric events carry the real time)
FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"


# ------------------------------------------------------------------------------ a run the model reads
class Run:
    """A run directory as the supervisor and the stages leave it: the stages' rows and events, watched by the
    supervisor's :class:`RunWatcher` (what it raises lands in ``alerts.jsonl``)."""

    def __init__(self, root: Path, **rules: Any) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.rows: dict[str, dict[str, Any]] = {}
        self.watcher = RunWatcher(RunDir(root), AlertsSection(**rules), lambda _text: None)

    def stage(self, sid: str, **row: Any) -> StageContext:
        self.rows[sid] = {"id": sid, "family": sid, "state": "running", "attempt": 1, "started_at": T0, **row}
        return StageContext(
            sid, self.root / "stages" / sid / "out", self.root / "stages" / sid / "events.jsonl", None
        )

    def status(self) -> dict[str, StageRow]:
        out = {}
        for sid, d in self.rows.items():
            row = StageRow(id=sid, family=sid)
            row.update_from(d)
            out[sid] = row
        return out

    async def alerts(self, now: float | None = None) -> list[Alert]:
        """The alerts one supervisor cycle raises (read back from the run's record file)."""
        before = set(record.read(self.root))
        self.watcher.tick(self.status(), time.time() if now is None else now)
        book = record.read(self.root)
        return [book[i] for i in sorted(set(book) - before)]


def losses(n: int, start: int = 0) -> list[float]:
    """A healthy EAGLE-3 loss curve: falls fast, then slowly, with ±4 % step-to-step noise."""
    return [
        (7.0 * math.exp(-(start + i) / 40) + 2.0) * (1 + 0.04 * math.sin(7.3 * (start + i))) for i in range(n)
    ]


async def test_a_nan_or_inf_loss_alerts_once_per_episode_with_the_last_finite_values(tmp_path: Path) -> None:
    run = Run(tmp_path)
    ctx = run.stage("train", run="train")
    for i, v in enumerate(losses(30)):
        ctx.metric("loss", v, step=10 * i)
    assert await run.alerts() == [], "a healthy curve"
    ctx.metric("loss", float("nan"), step=300)
    ctx.metric("loss", float("nan"), step=310)
    (a,) = await run.alerts()
    assert (a.kind, a.key, a.stage, a.attempt) == (
        "loss-nonfinite",
        "loss-nonfinite:train:1:step300",
        "train",
        1,
    )
    assert a.title == "train: loss is nan"
    assert a.evidence[0] == "loss = nan at step 300"
    assert a.evidence[1].startswith("last finite losses: ") and "(step 290)" in a.evidence[1]
    ctx.metric("loss", float("nan"), step=320)
    assert await run.alerts() == [], "the same episode"
    ctx.metric("loss", 2.4, step=330)
    ctx.metric("loss", float("inf"), step=340)
    (b,) = await run.alerts()
    assert b.key == "loss-nonfinite:train:1:step340" and b.evidence[0] == "loss = inf at step 340"
    restarted = Run(tmp_path)  # a supervisor started after this one died: nothing raised twice
    restarted.rows = run.rows
    assert await restarted.alerts() == []
    for step in range(350, 350 + 16_000):  # the episode goes on past the MiB a restarted watcher reads
        ctx.metric("loss", float("inf"), step=step)
    assert (tmp_path / "stages" / "train" / "events.jsonl").stat().st_size > 1 << 20
    assert await run.alerts() == [], "the same episode"
    tail_only = Run(tmp_path)  # restarted: it reads the last MiB, where the episode looks younger
    tail_only.rows = run.rows
    assert await tail_only.alerts() == [], "the open episode is not raised again"
    (tmp_path / "alerts.jsonl").unlink()  # no record at all: the latest episode once
    fresh = Run(tmp_path)
    fresh.rows = run.rows
    assert [x.kind for x in await fresh.alerts()] == ["loss-nonfinite"]


async def test_divergence_fires_after_two_points_over_k_times_the_window_minimum_and_rearms(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, diverge_factor=3.0, diverge_window=50)
    ctx = run.stage("train", run="train")
    curve = losses(200)
    curve[120] *= 3.5  # one spike: not a trend
    for i, v in enumerate(curve):
        ctx.metric("loss", v, step=i)
    assert await run.alerts() == [], "healthy, with one spike"
    low = min(curve[150:200])
    for step, v in ((200, 3.3 * low), (201, 3.6 * low), (202, 4.0 * low), (203, 3.9 * low)):
        ctx.metric("loss", v, step=step)
    (a,) = await run.alerts()
    assert a.kind == "loss-diverging" and a.key == "loss-diverging:train:1:step200"
    assert a.evidence[0] == f"loss {3.3 * low:.4g} at step 200, {3.6 * low:.4g} at step 201"
    low = min(curve[151:200])  # the window when it fired: the 50 points before step 201
    assert a.evidence[1].startswith(f"minimum of the previous 50 points: {low:.4g} at step ")
    assert a.evidence[2] == f"rule: loss above 3 × {low:.4g} = {3 * low:.4g}, 2 points in a row"
    for i, v in enumerate(losses(5, start=200)):  # back under the line: re-armed
        ctx.metric("loss", v, step=204 + i)
    ctx.metric("loss", 5 * low, step=209)
    ctx.metric("loss", 5 * low, step=210)
    (b,) = await run.alerts()
    assert b.key == "loss-diverging:train:1:step209"


async def test_acceptance_falling_while_the_loss_falls_fires_once_and_not_for_healthy_evaluations(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, accept_window=3, accept_drop=0.05)
    ctx = run.stage("train", run="train")
    curve = [2.0 + 5.0 * math.exp(-s / 150) for s in range(700)]  # the smoothed training loss: still falling
    accepts = {100: 2.10, 200: 2.42, 300: 2.61, 400: 2.58, 500: 2.60}  # rising, then flat within noise
    for step, v in enumerate(curve[:600]):
        ctx.metric("loss", v, step=step)
        if step in accepts:
            ctx.metric("accept_length", accepts[step], step=step)
    assert await run.alerts() == [], "acceptance rose, then held"
    for step, acc in ((600, 2.52), (650, 2.41), (690, 2.33)):
        ctx.metric("loss", curve[step], step=step)
        ctx.metric("accept_length", acc, step=step)
    (a,) = await run.alerts()
    assert a.kind == "accept-falling" and a.key == "accept-falling:train:1:step500"
    assert a.evidence[0] == "accept_length 2.6 (step 500) → 2.52 (step 600) → 2.41 (step 650)"
    assert a.evidence[1].startswith("loss at those evaluations ")
    assert "7.3%" in a.text
    # A falling acceptance while the loss rises is the divergence rule's business, not this one's.
    run2 = Run(tmp_path / "b", accept_window=3)
    ctx2 = run2.stage("train", run="train")
    for step, (loss, acc) in enumerate(((2.0, 2.6), (2.4, 2.4), (2.9, 2.1))):
        ctx2.metric("loss", loss, step=step)
        ctx2.metric("accept_length", acc, step=step)
    assert await run2.alerts() == []


def sglang_decode(t: int, running: int, tps: float) -> str:
    """One SGLang scheduler line as it prints it (tests/fixtures/sglang/decode_period_tp0.log's format)."""
    return (
        f"[2025-02-27 04:{t // 60:02d}:{t % 60:02d} TP0] Decode batch. #running-req: {running}, #token: 62531, "
        f"token usage: 0.12, gen throughput (token/s): {tps:.2f}, #queue-req: 0"
    )


async def test_server_throughput_collapse_under_load_fires_once_but_not_when_the_load_drops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_stage, "METRIC_INTERVAL_S", 0.0)  # every line a metric (the stage samples 1/s)
    run = Run(tmp_path, throughput_fraction=0.3, throughput_window=30)
    ctx = run.stage("serve", run="serve", service=True, health="ready")

    async def serve(lines: list[str]) -> list[Alert]:
        follower = serve_stage.LogFollower(io.BytesIO("\n".join(lines).encode() + b"\n"), ctx, ServerStats())
        follower.run()  # the thread's body, here
        return await run.alerts()

    steady = [sglang_decode(i, 32, 1600 + 40 * math.sin(i)) for i in range(30)]
    lighter = [sglang_decode(30 + i, 2, 190.0) for i in range(5)]  # fewer requests: lower tok/s, fine
    assert await serve(steady + lighter) == []
    (a,) = await serve([sglang_decode(40 + i, 31, 120.0 + i) for i in range(6)])
    assert a.kind == "server-throughput" and a.stage == "serve"
    assert a.evidence[0].startswith("gen_throughput 120 tok/s with 31 running at ")
    assert (
        a.evidence[1].startswith("median of the last 30 samples: ")
        and "with 32 requests running" in a.evidence[1]
    )
    assert "under 0.3 × its recent median" in a.text
    assert await serve(steady[:3]) == [], "recovered"
    (b,) = await serve([sglang_decode(50 + i, 32, 100.0) for i in range(2)])
    assert b.key != a.key, "a new episode"
    ctx.health("unhealthy", detail="3 failed probes: connection refused")
    ctx.health("unhealthy", detail="4 failed probes: connection refused")
    (c,) = await run.alerts()
    assert c.kind == "server-unhealthy" and "connection refused" in c.evidence[0]


async def test_a_silent_running_stage_alerts_after_stall_minutes_and_rearms_on_news(tmp_path: Path) -> None:
    run = Run(tmp_path, stall_minutes=30)
    train = run.stage("train", run="train")
    run.stage("copy", run=None)  # an operator command that never reports: its silence is normal
    run.stage("serve", run="serve", service=True)  # a server reports no progress
    paused = run.stage("paused", run="prep", state="paused")
    for ctx in (train, paused):
        ctx.emit("progress", done=6, total=100, unit="steps", t=T0 + 60)
    train.emit("metric", name="loss", value=3.25, step=6, t=T0 + 90)
    last = T0 + 90
    assert await run.alerts(now=last + 29 * 60) == []
    (a,) = await run.alerts(now=last + 31 * 60)
    assert a.kind == "stalled" and a.stage == "train" and a.key == f"stalled:train:1:t{int(last)}"
    assert a.title == "train: no progress for 31m"
    assert a.evidence == [
        "rule: no progress and no metric for 30 min",
        "last progress 6/100 steps 31m ago",
        "last metric loss = 3.25 31m ago",
    ]
    assert await run.alerts(now=last + 40 * 60) == [], "once per silence"
    train.emit("progress", done=7, total=100, unit="steps", t=last + 41 * 60)  # news: re-armed
    assert await run.alerts(now=last + 42 * 60) == []
    (b,) = await run.alerts(now=last + 72 * 60)
    assert b.key == f"stalled:train:1:t{int(last + 41 * 60)}"


@pytest.mark.parametrize("executor", ["local", "ssh", "slurm"])
async def test_idle_gpus_of_a_running_stage_alert_from_fake_nvml_samples(
    tmp_path: Path, executor: str
) -> None:
    """FAKE NVML (pipeline.run.hosts.gpus.FakeNvmlReplay) replays the real H200 recording through the telemetry
    agent: GPU 0 idle for samples 1–13 (26 s), then 99–100 % busy; the replay cycles. Local and SSH runs sample
    their stages' own GPUs (the supervisor's host); a Slurm run's stages hold GPUs on other nodes."""
    run = Run(tmp_path, gpu_idle_minutes=0.2, gpu_idle_util=5)  # 12 s
    rules = AlertsSection(gpu_idle_minutes=0.2, gpu_idle_util=5)
    run.watcher = for_plan(RunDir(tmp_path), rules, executor, lambda _text: None)
    run.stage("gpuwork", run="train", gpus=[0], started_at=T0)
    run.stage("serve", run="serve", service=True, gpus=[0], started_at=T0)  # a server may idle
    agent = Agent(FakeNvmlReplay(FIXTURE), tmp_path / "agent", message=lambda text, **kw: None)
    run.stage("telemetry", run="telemetry", service=True, started_at=T0)
    out = tmp_path / "stages" / "telemetry" / "out" / "telemetry.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    fired: list[tuple[int, Alert]] = []
    for i in range(1, 43):  # two passes over the 21 samples, 2 s apart
        recs = [dict(r, t=T0 + 2 * i) for r in agent.sample() if r["kind"] == "gpu"]
        with out.open("a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in recs))
        fired += [(i, a) for a in await run.alerts(T0 + 2 * i)]
    agent.close()
    if executor == "slurm":
        assert fired == [], "this host's GPUs are not the Slurm stage's"
        return
    assert [i for i, _ in fired] == [7, 28], "12 s into each idle stretch, once each"
    a = fired[0][1]
    assert a.kind == "gpu-idle" and a.stage == "gpuwork" and a.title == "gpuwork: GPU 0 idle"
    assert a.evidence[0].startswith("GPU 0: utilisation 0% for 12s, memory ")
    assert a.evidence[-1] == "rule: at or below 5% for 0.2 min"
    assert fired[1][1].key != a.key


def test_thresholds_are_plan_keys_with_defaults_and_bad_values_name_file_and_key() -> None:
    assert AlertsSection().stall_minutes == 30.0
    keys = {k for k, *_ in AlertsSection.describe()}
    assert {
        "stall_minutes",
        "diverge_factor",
        "accept_window",
        "gpu_idle_minutes",
        "throughput_fraction",
    } <= keys
    plan = {"alerts": {"stall_minutes": 45, "diverge_factor": 1, "gpu_idle_util": 150}}
    user = {"alerts": {"accept_window": 5, "stall_minutes": 60}}
    s = resolve(None, user, "cfg.toml", plan, "RUN/plan.toml", ["aerie-dark"])
    # The rules run on the executing host with the plan's values: the user's config cannot change them there.
    assert (s.rules.stall_minutes, s.rules.accept_window, s.rules.diverge_factor) == (45.0, 3, 3.0)
    assert (
        "cfg.toml: alerts.stall_minutes: the rules run on the executing host: set it in the plan"
        in s.problems
    )
    assert "RUN/plan.toml: alerts.diverge_factor: must be 0 (off) or above 1, got 1.0" in s.problems
    assert any(p.startswith("RUN/plan.toml: alerts.gpu_idle_util: 150 is out of range") for p in s.problems)


# ------------------------------------------------------------------------------ through the console
# The stage holds until the test has seen the console attach (a console toasts only what is raised after it
# attached; the alert list has the rest), then logs a loss curve that ends in nan.
NAN_STAGE = (
    "import os, sys, time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"
    "for i in range(8):\n    ctx.metric('loss', 3.0 - 0.1 * i, step=i)\n"
    "ctx.metric('loss', float('nan'), step=8)\ntime.sleep(60)\n"
)


async def test_an_anomaly_raised_on_the_host_reaches_the_hook_the_toast_and_the_bell_with_its_stage(
    tmp_path: Path,
) -> None:
    (tmp_path / "nan.py").write_text(NAN_STAGE)
    hook_log = tmp_path / "hook.log"
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "odd"
        dir = "run"
        [alerts]
        command = "echo \\"$AERIE_ALERT_KIND|$AERIE_ALERT_STAGE|$AERIE_ALERT_EVIDENCE\\" >> {hook_log}"
        [[stage]]
        id = "first"
        command = "true"
        [[stage]]
        id = "trainer"
        command = "{sys.executable} {tmp_path / "nan.py"} {tmp_path / "go"}"
        kill_grace_s = 1
        """,
    )
    sup = start_supervisor(run)
    try:
        app = AerieApp(LocalTransport(str(run.root)), poll_s=0.2, user_config={})
        notes: list[str] = []
        bells: list[int] = []
        orig = app.notify
        app.notify = lambda message, **kw: (notes.append(str(message)), orig(message, **kw))[1]  # type: ignore[method-assign]
        app.bell = lambda: bells.append(1)  # type: ignore[method-assign]
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: app.alerts.seen is not None, what="the console attached to the alerts")
            (tmp_path / "go").touch()
            await until(pilot, lambda: app.alerts.announced >= 1, what="the alert's toast")
            note = next(n for n in notes if "loss became nan" in n)
            assert "loss = nan at step 8" in note and "[a: alerts, Enter: go to trainer]" in note
            assert bells == [1]
            board = app.query_one(StageBoard)
            await pilot.press("home")  # away from the stage the console selected on attach (the running one)
            await until(pilot, lambda: board.selected_key == "first", what="first selected")
            await pilot.press("a")  # the alert list keeps the alert after its toast is gone
            await until(pilot, lambda: isinstance(app.screen, AlertsScreen), what="the alert list")
            text = "\n".join(svg_rows(app.export_screenshot()))
            assert "trainer: loss is nan" in text or "loss = nan at step 8" in text, text
            await pilot.press("enter")
            await until(pilot, lambda: board.selected_key == "trainer", what="the alerted stage selected")
        wait_for(
            lambda: hook_log.exists() and hook_log.read_text().endswith("\n"), 20, "the hook, on the host"
        )
        kind, stage, evidence = hook_log.read_text().split("|", 2)
        assert (kind, stage) == ("loss-nonfinite", "trainer") and "loss = nan at step 8" in evidence
    finally:
        stop(sup)
        kill_run_stages(run)


async def test_a_served_accept_length_well_below_the_simulated_one_raises_accept_gap_with_both_sources(
    tmp_path: Path,
) -> None:
    """Issue 44 item 10, with the figures the lent H100 gave: simulated 2.72 at step 200, served 2.19."""
    from pipeline.manifests.train import DraftManifest
    from pipeline.stages.bench.gap import gap_record, report_gap

    man = DraftManifest(kind="draft", aux_layer_ids=(1, 2, 3), step=200, accept_length=2.72)
    train_dir = tmp_path / "stages" / "train" / "out"
    run = Run(tmp_path, accept_gap=0.15, stall_minutes=0)  # (the stages started an hour ago)
    close = run.stage("bench-close", run="bench")
    report_gap(close, gap_record(man, train_dir, 2.60, "bench-close results.json: batches[0]"))  # 4.4 %: fine
    far = run.stage("bench-eagle3", run="bench")
    report_gap(far, gap_record(man, train_dir, 2.19, "bench-eagle3 results.json: batches[0] (batch 1)"))
    (a,) = await run.alerts()
    assert (a.kind, a.stage) == ("accept-gap", "bench-eagle3")
    assert "2.19" in a.text and "2.72" in a.text and "19.5%" in a.text
    assert a.evidence[0] == "served 2.19: bench-eagle3 results.json: batches[0] (batch 1)"
    assert (
        a.evidence[1]
        == f"simulated 2.72: {train_dir / 'manifest.json'}: accept_length at step 200 (held-out rows)"
    )
    run.rows["bench-eagle3"]["state"] = "succeeded"  # the bench ended: the gap stays open for its attempt
    assert await run.alerts() == [] and record.read(tmp_path)[a.id].open
    lines = record.status_lines(list(record.read(tmp_path).values()), time.time())
    assert any("accept-gap" in ln and "bench-eagle3" in ln for ln in lines), lines
    assert gap_record(man, train_dir, None, "x") is None, "no served figure: nothing to compare"
    assert gap_record(DraftManifest(kind="draft", aux_layer_ids=(1,)), train_dir, 2.0, "x") is None


async def test_a_restarted_supervisor_keeps_an_open_gap_and_raises_one_that_came_while_none_ran(
    tmp_path: Path,
) -> None:
    """A restart (``aerie retry`` after the run ended, a SIGKILL and an attach) neither clears the accept-gap of
    a bench that ended nor misses the gap of a bench that ended while no supervisor ran."""
    from pipeline.manifests.train import DraftManifest
    from pipeline.stages.bench.gap import gap_record, report_gap

    man = DraftManifest(kind="draft", aux_layer_ids=(1, 2, 3), step=200, accept_length=2.72)
    run = Run(tmp_path, accept_gap=0.15, stall_minutes=0)
    report_gap(run.stage("bench-a", run="bench"), gap_record(man, tmp_path, 2.19, "bench-a: batches[0]"))
    (a,) = await run.alerts()
    run.rows["bench-a"].update(state="succeeded", finished_at=time.time())
    assert await run.alerts() == []
    (tmp_path / "state.json").write_text("{}")  # the old supervisor's last snapshot, then it is gone
    snapshot_t = (tmp_path / "state.json").stat().st_mtime
    late = run.stage("bench-b", run="bench", state="succeeded", finished_at=snapshot_t + 5)
    report_gap(late, gap_record(man, tmp_path, 2.05, "bench-b: batches[0]"))

    run.watcher = RunWatcher(
        RunDir(tmp_path), AlertsSection(accept_gap=0.15, stall_minutes=0), lambda _t: None
    )
    (b,) = await run.alerts()
    assert (b.kind, b.stage, b.open) == ("accept-gap", "bench-b", True)
    assert "2.05" in b.text and "2.72" in b.text
    assert await run.alerts() == []
    book = record.read(tmp_path)
    assert book[a.id].open, "the ended bench's gap was cleared by the restart"
    assert [r.id for r in book.values() if r.kind == "accept-gap"] == [a.id, b.id]


async def test_an_alert_that_cannot_be_written_is_written_at_the_next_cycle(tmp_path: Path) -> None:
    """A full or unwritable run dir (here: alerts.jsonl is a directory) loses no alert: the cycle raises, the
    supervisor reports it, and the next cycle writes what was found."""
    run = Run(tmp_path, stall_minutes=0)
    ctx = run.stage("train", run="train")
    ctx.metric("loss", float("nan"), step=3)
    (tmp_path / "alerts.jsonl").mkdir()
    with pytest.raises(OSError):
        await run.alerts()
    (tmp_path / "alerts.jsonl").rmdir()
    (a,) = await run.alerts()
    assert (a.kind, a.key) == ("loss-nonfinite", "loss-nonfinite:train:1:step3")
    assert await run.alerts() == []
