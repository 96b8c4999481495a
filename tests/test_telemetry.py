"""The telemetry agent: the no-driver path on this machine with real disk and host numbers, rotation,
process ownership, errors that must not stop it, SIGTERM, and the service under a real supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.run.hosts.gpus import FakeNvmlReplay, GpuUnavailable
from pipeline.run.hosts.procs import ProcIdentity, read_stat
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.layout import RunDir, write_json
from pipeline.stages.telemetry import FILE_NAME, Agent, settings
from tests.runs import (
    ROOT,
    events,
    jsonl,
    kill_run_stages,
    make_run,
    start_supervisor,
    stop,
    wait_done,
    wait_for,
)

FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"


def _agent_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.stages.telemetry", "--out", str(out), *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_no_driver_says_so_once_and_reports_real_disk_and_host(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = subprocess.run(
        _agent_cmd(out, "--interval", "0.1", "--samples", "4"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    recs = jsonl(out / FILE_NAME)
    meta = recs[0]
    assert meta["kind"] == "meta" and meta["nvml"]["ok"] is False
    assert "no NVIDIA driver" in meta["nvml"]["error"]
    assert not [r for r in recs if r["kind"] == "gpu"]
    evs = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    no_gpu = [e for e in evs if e.get("code") == "no-gpu"]
    assert len(no_gpu) == 1 and "reporting disk and host only" in no_gpu[0]["text"]
    disks = [r for r in recs if r["kind"] == "disk"]
    hosts = [r for r in recs if r["kind"] == "host"]
    assert [r["seq"] for r in disks] == [1, 2, 3, 4] == [r["seq"] for r in hosts]
    st = os.statvfs(out)
    assert disks[-1]["total"] == st.f_blocks * st.f_frsize
    assert abs(disks[-1]["avail"] - st.f_bavail * st.f_frsize) < 1 << 30
    assert disks[0]["rate_bps"] is None and isinstance(disks[-1]["rate_bps"], float)
    meminfo = Path("/proc/meminfo").read_text().split()
    assert hosts[-1]["mem_total"] == int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    assert hosts[-1]["ncpu"] == os.cpu_count()
    assert 0 <= hosts[-1]["cpu_pct"] <= 100


def test_sigterm_ends_the_agent_at_once_and_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = subprocess.Popen(
        _agent_cmd(out, "--interval", "3600"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (out / FILE_NAME).exists() and "host" in (out / FILE_NAME).read_text(), 30, "a sample"
        )
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0  # an hour-long wait did not delay it
    finally:
        if p.poll() is None:
            p.kill()
    evs = (out / "events.jsonl").read_text()
    assert "telemetry agent stopped (stopped by SIGTERM)" in evs
    lines = (out / FILE_NAME).read_bytes()
    assert lines.endswith(b"\n")  # no torn record


def _agent(
    tmp_path: Path, source: object, run: RunDir | None = None, **kw: object
) -> tuple[Agent, list[dict]]:
    said: list[dict] = []
    agent = Agent(
        source,
        tmp_path / "out",
        run=run,  # type: ignore[arg-type]
        message=lambda text, **k: said.append({"text": text, **k}),
        **kw,
    )  # type: ignore[arg-type]
    return agent, said


def test_the_file_is_capped_by_rotation_and_each_file_opens_with_meta(tmp_path: Path) -> None:
    cap = 20_000
    agent, _ = _agent(tmp_path, FakeNvmlReplay(FIXTURE, replicate=8), max_bytes=cap)
    biggest = 0
    for _ in range(60):
        biggest = max(biggest, sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in agent.sample()))
    agent.close()
    cur, old = tmp_path / "out" / FILE_NAME, tmp_path / "out" / (FILE_NAME + ".1")
    assert old.exists() and not (tmp_path / "out" / (FILE_NAME + ".2")).exists()
    for f in (cur, old):
        assert f.stat().st_size < cap + biggest  # at most one sample past the cap, then it rotates
        assert jsonl(f)[0]["kind"] == "meta"
    gpus = [r for r in jsonl(cur) if r["kind"] == "gpu"]
    assert sorted({g["index"] for g in gpus}) == list(range(8))


def test_gpu_processes_are_mapped_to_their_stage_or_foreign(tmp_path: Path) -> None:
    run = make_run(tmp_path, '[run]\nname="t"\ndir="run"\n[[stage]]\nid="extract"\ncommand="true"\n')
    # The stage's process group: a leader and a grandchild that started its own session.
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import subprocess, sys, time\n"
                "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
                "print(c.pid, flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        escaped = int(leader.stdout.readline())  # type: ignore[union-attr]
        st = read_stat(leader.pid)
        assert st is not None
        write_json(
            run.stage("extract").proc,
            {"attempt": 1, **ProcIdentity(leader.pid, st.pgid, st.start_time, "").to_dict(), "t": 0},
        )
        recs = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
        g = next(r for r in recs if r["kind"] == "gpu" and r["procs"])
        g["procs"] = [dict(g["procs"][0], pid=pid) for pid in (leader.pid, escaped, stranger.pid)]
        fx = tmp_path / "fx.jsonl"
        fx.write_text(json.dumps(recs[0]) + "\n" + json.dumps(g) + "\n")
        agent, _ = _agent(tmp_path, FakeNvmlReplay(fx), run=run)
        gpu = next(r for r in agent.sample() if r["kind"] == "gpu")
        agent.close()
        owners = {p["pid"]: p["owner"] for p in gpu["procs"]}
        assert owners == {leader.pid: "extract", escaped: "extract", stranger.pid: "foreign"}
        assert all(p["name"].startswith("python") for p in gpu["procs"])
    finally:
        for p in (leader, stranger):
            p.kill()
            p.wait()
        if "escaped" in locals():
            os.kill(escaped, signal.SIGKILL)


class ExplodingFakeNvml:
    """A FAKE NVML whose samples fail (a driver hiccup): the agent must keep reporting."""

    def open(self) -> dict:
        return {"source": "fake-exploding", "count": 1}

    def sample(self) -> list[dict]:
        raise RuntimeError("Unknown Error")

    def close(self) -> None:
        raise GpuUnavailable("already gone")


def test_reading_errors_are_reported_once_and_never_stop_the_agent(tmp_path: Path) -> None:
    agent, said = _agent(tmp_path, ExplodingFakeNvml())
    kinds = [[r["kind"] for r in agent.sample()] for _ in range(3)]
    agent.close()  # a failing close is swallowed too
    assert kinds == [["disk", "host"]] * 3
    errors = [m for m in said if m.get("code") == "telemetry-error"]
    assert len(errors) == 1 and "RuntimeError: Unknown Error" in errors[0]["text"]


def test_plan_settings_are_validated_with_the_key_named(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        '[run]\nname="t"\ndir="run"\n[telemetry]\ninterval_s = 0\n[[stage]]\nid="a"\ncommand="true"\n'
    )
    with pytest.raises(ValueError, match=r"p\.toml: telemetry\.interval_s: must be > 0, got 0"):
        settings(plan_mod.load(path))
    path.write_text(
        '[run]\nname="t"\ndir="run"\n[telemetry]\ninterval_s = 5\n[[stage]]\nid="a"\ncommand="true"\n'
    )
    assert settings(plan_mod.load(path))[0] == 5.0


@pytest.mark.slow
def test_service_under_the_supervisor_reports_projection_and_stops_when_the_run_is_done(
    tmp_path: Path,
) -> None:
    run = make_run(
        tmp_path,
        """
        [run]
        name = "t"
        dir = "run"
        [telemetry]
        interval_s = 0.2
        [[stage]]
        id = "telemetry"
        run = "telemetry"
        service = true
        cpu = 0
        [[stage]]
        id = "work"
        command = "sleep 2"
        [[stage]]
        id = "later"
        command = "true"
        after = ["work"]
        output_bytes = 5000000
        """,
    )
    sup = start_supervisor(run)
    try:
        path = run.stage("telemetry").out / FILE_NAME
        wait_for(
            lambda: path.exists() and '"projected_remaining":5000000' in path.read_text(),
            30,
            "the projection of the pending stage in a disk record",
        )
        final = wait_done(run, 60)
        assert final["telemetry"] == "succeeded"
        fin = events(run, "telemetry", "finished")[-1]
        assert fin.get("returncode") == 0  # ended by its SIGTERM, not the SIGKILL after the grace
        assert not (
            run.stage("telemetry").kill_marker.exists()
            and json.loads(run.stage("telemetry").kill_marker.read_text()).get("sigkill")
        )
        disks = [r for r in jsonl(path) if r["kind"] == "disk"]
        assert disks[0]["path"] == str(run.root)
    finally:
        stop(sup)
        kill_run_stages(run)
