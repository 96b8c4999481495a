"""The server stage with its real local backend (transformers serve on the CPU): preflight, health, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.run.hosts.procs import group_members
from pipeline.run.rundir.events import read_all
from pipeline.stages.serve.health import HealthTracker
from tests.runs import ROOT, wait_for, write_plan

PLAN = """
[run]
name = "serve-test"
dir = "run"
[target]
model = "builtin:smollm2-135m-instruct"
max_length = 512
[serve]
backend = "local"
port = {port}
startup_timeout_s = {startup}
health_interval_s = 0.5
{extra}
[[stage]]
id = "serve"
run = "serve"
service = true
"""


def start_serve(
    tmp: Path, port: int = 0, startup: float = 120, extra: str = ""
) -> tuple[subprocess.Popen, Path]:
    plan = write_plan(tmp, PLAN.format(port=port, startup=startup, extra=extra))
    out = tmp / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    # Its own session, as the launcher gives it: the supervisor signals that group.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.stages.serve",
            "--plan",
            str(plan),
            "--out",
            str(out),
            "--stage",
            "serve",
        ],
        env=env,
        start_new_session=True,
        stdout=open(tmp / "stage.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    return proc, out


def evs(out: Path, type_: str | None = None) -> list:
    path = out / "events.jsonl"
    return [e for e in (read_all(path) if path.exists() else []) if type_ is None or e.type == type_]


def health(out: Path) -> list[str]:
    return [e.get("state") for e in evs(out, "health")]


def messages(out: Path) -> list:
    return evs(out, "message")


def test_port_in_use_is_refused_before_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, out = start_serve(tmp_path, port=port)
        assert proc.wait(timeout=60) == 3
    assert health(out) == ["starting", "unhealthy"]
    err = [m for m in messages(out) if m.get("level") == "error"]
    assert len(err) == 1
    assert f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in err[0].get("text")
    assert not any(m.get("code") == "launch" for m in messages(out))  # nothing was started


def test_bad_plan_names_the_key(tmp_path):
    proc, out = start_serve(tmp_path, extra="dtype = 3")
    assert proc.wait(timeout=60) == 2
    err = [m.get("text") for m in messages(out) if m.get("level") == "error"]
    assert err and "serve.dtype: expected a string, got int 3" in err[0]


def test_health_tracker_transitions():
    t = HealthTracker(startup_timeout_s=10, unhealthy_after=2)
    assert t.update(False, 1) is None and t.state == "starting"
    assert t.update(True, 2) == "ready"
    assert t.update(False, 3) is None  # one failed probe is not yet unhealthy
    assert t.update(False, 4) == "unhealthy" and not t.startup_expired
    assert t.update(True, 5) == "ready"
    t2 = HealthTracker(startup_timeout_s=1)
    assert t2.update(False, 2) == "unhealthy" and t2.startup_expired


def chat(url: str, text: str, max_tokens: int = 8) -> dict:
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())
    body = json.dumps(
        {
            "model": models["data"][0]["id"],
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


@pytest.mark.slow
def test_local_server_ready_answers_and_stops_on_group_sigterm(tmp_path):
    proc, out = start_serve(tmp_path)
    try:
        wait_for(lambda: "ready" in health(out) or proc.poll() is not None, 180, "the server to be ready")
        assert proc.poll() is None, (tmp_path / "stage.log").read_text()[-2000:]
        ep = json.loads((out / "endpoint.json").read_text())
        assert ep["state"] == "ready" and ep["backend"] == "local" and ep["port"] > 0
        answer = chat(ep["url"], "Say hello.")
        assert answer["choices"][0]["message"]["content"].strip()
        wait_for(
            lambda: any(e.get("name") == "requests" and e.get("value") >= 1 for e in evs(out, "metric")),
            30,
            "the request to be counted from the server's access log",
        )
        server_pid = ep["pid"]
        assert server_pid in group_members(proc.pid)  # the server lives in the stage's group
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what the supervisor does to an idle service
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert group_members(proc.pid) == []  # nothing left behind
    assert health(out) == ["starting", "ready", "stopped"]
    assert json.loads((out / "endpoint.json").read_text())["state"] == "stopped"
    log = (tmp_path / "stage.log").read_text()
    assert "Uvicorn running on" in log  # the server's own lines reach the stage log
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert '"GET /health HTTP/1.1" 200' not in log  # our probes are not copied
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ep["port"]))


@pytest.mark.slow
def test_startup_timeout_is_unhealthy_and_stops_the_server(tmp_path):
    proc, out = start_serve(tmp_path, startup=1)
    assert proc.wait(timeout=90) == 1
    assert health(out)[-2:] == ["unhealthy", "stopped"]
    assert any(m.get("code") == "startup-timeout" for m in messages(out))
    assert group_members(proc.pid) == []


@pytest.mark.slow
def test_server_crash_is_reported_unhealthy(tmp_path):
    proc, out = start_serve(tmp_path)
    try:
        wait_for(lambda: "ready" in health(out) or proc.poll() is not None, 180, "the server to be ready")
        pid = json.loads((out / "endpoint.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert health(out) == ["starting", "ready", "unhealthy", "stopped"]
    crash = [m for m in messages(out) if m.get("code") == "server-exited"]
    assert crash and "exited with code -9 after it was ready" in crash[0].get("text")


def test_gpu_guard_names_foreign_holders_from_a_real_h200_recording():
    """FAKE NVML (pipeline.run.hosts.gpus.FakeNvmlReplay): replays GPU samples recorded on a real H200 where a
    foreign python3 (pid 424) held GPU 0. No GPU here, so the real NVML path can only say so."""
    from pipeline.run.hosts.gpus import FakeNvmlReplay, GpuProbe
    from pipeline.stages.serve.preflight import gpu_problem

    fixture = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"
    probe = GpuProbe(FakeNvmlReplay(fixture), ttl_s=0)
    problem, note = gpu_problem((0,), None, "serve", probe=probe)
    assert note is None and problem.startswith("GPU 0 held by pid 424 (") and problem.endswith(", foreign)")
    problem, _ = gpu_problem((0, 1), None, "serve", probe=probe)
    assert "GPU 1 does not exist on this host (GPUs: [0])" in problem
    assert gpu_problem((), None, "serve", probe=probe) == (None, None)  # a CPU server needs no check
    problem, note = gpu_problem((0,), None, "serve")  # real NVML on this GPU-less machine
    assert problem is None and note.startswith("GPU guard skipped: ")
