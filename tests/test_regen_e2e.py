"""Regeneration against the real CPU server (transformers serve + SmolLM2-135M-Instruct).

Requests are counted on the server side by a counting proxy on loopback (it forwards to the real
server and tallies each prompt it sees), so "no record asked twice" does not rely on the client's word.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from aiohttp import ClientSession, web

from pipeline.run.hosts.procs import group_members
from pipeline.run.rundir.events import read_all
from tests.runs import ROOT, make_run, start_supervisor, stop, wait_done, wait_for, write_plan
from tests.test_regen import free_port, make_prompts

pytestmark = pytest.mark.slow

PLAN = """
[run]
name = "regen-test"
dir = "run"
[resources]
cpu_slots = 2
[target]
model = "builtin:smollm2-135m-instruct"
max_length = 512
[[datasets]]
name = "toy"
source = "local"
kind = "prompt-only"
quota = 10
[serve]
backend = "local"
port = {port}
startup_timeout_s = 180
health_interval_s = 0.5
[regen]
concurrency = 2
max_tokens = 8
temperature = 0.0
backoff_s = 0.2
backoff_max_s = 1.0
[[stage]]
id = "serve"
run = "serve"
service = true
[[stage]]
id = "regen"
run = "regen"
for_each = "dataset"
when = {{kind = "prompt-only"}}
uses = ["serve"]
args = ["--input", "{prompts}"]
kill_grace_s = 120  # SIGTERM lets requests in flight finish: generous on a loaded 2-core machine
"""


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


class Server:
    """The serve stage run by hand (its own session, like under the launcher)."""

    def __init__(self, plan: Path, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
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
            env=env(),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self.ready_or_dead, 180, "the CPU server to be ready")
        assert self.proc.poll() is None, "the serve stage died during startup"
        self.endpoint = json.loads((out / "endpoint.json").read_text())
        self.url = self.endpoint["url"]

    def ready_or_dead(self) -> bool:
        p = self.out / "events.jsonl"
        ready = p.exists() and any(e.type == "health" and e.get("state") == "ready" for e in read_all(p))
        return ready or self.proc.poll() is not None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class CountingProxy:
    """Loopback HTTP proxy in front of the real server: counts each prompt's chat requests."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.counts: collections.Counter[str] = collections.Counter()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, req: web.Request) -> web.Response:
        body = await req.read()
        if req.path.endswith("/chat/completions"):
            self.counts[json.loads(body)["messages"][-1]["content"]] += 1
        async with self._session.request(
            req.method,
            self.upstream + req.path_qs,
            data=body,
            headers={"Content-Type": req.headers.get("Content-Type", "")},
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    def close(self) -> None:
        async def _stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu-server")
    plan = write_plan(d, PLAN.format(port=0, prompts=d))
    srv = Server(plan, d / "out")
    yield srv
    srv.stop()


def prompts_dir(tmp: Path, n: int) -> Path:
    return make_prompts(tmp / "prompts", n)


def prompt_text(i: int) -> str:
    return f"question {i}"


def run_regen(tmp: Path, url: str, out: Path) -> subprocess.Popen:
    plan = tmp / "plan.toml"
    if not plan.exists():
        write_plan(tmp, PLAN.format(port=0, prompts=tmp / "prompts"))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.stages.regen",
            "--plan",
            str(plan),
            "--dataset",
            "toy",
            "--input",
            str(tmp / "prompts"),
            "--out",
            str(out),
            "--server-url",
            url,
            "--stage",
            "regen.toy",
        ],
        env=env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "regen.err", "ab"),
    )  # noqa: SIM115


def answered(out: Path) -> list[str]:
    p = out / "responses.jsonl"
    if not p.exists():
        return []
    return [json.loads(ln)["id"] for ln in p.read_text().splitlines() if ln.endswith("}")]


def messages(out: Path, code: str) -> list:
    return [e for e in read_all(out / "events.jsonl") if e.type == "message" and e.get("code") == code]


def check_tokenized(out: Path, n: int) -> None:
    man = json.loads((out / "manifest.json").read_text())
    assert (
        man["kind"] == "tokenized"
        and man["rows"] == n
        and man["source"] == "local"
        and man["dataset"] == "toy"
    )
    assert (man["answers"], man["prompts"], man["rejects"], man["failed"], man["skipped"]) == (n, n, 0, 0, 0)
    assert man["regenerated_by"]["model"].endswith("smollm2-135m-instruct")
    assert man["regenerated_by"]["sampling"] == {"temperature": 0.0, "max_tokens": 8}
    assert man["tokens"] == sum(s["tokens"] for s in man["shards"]) > 0
    rows = pq.read_table(out / man["shards"][0]["file"]).to_pylist()
    recs = {json.loads(ln)["id"]: json.loads(ln) for ln in (out / "responses.jsonl").read_text().splitlines()}
    from pipeline.data.model_assets import load_tokenizer

    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    for r in rows:
        ids, mask = np.array(r["input_ids"]), np.array(r["loss_mask"])
        target = tok.decode(ids[mask == 1])
        reply = recs[r["id"]]["messages"][-1]["content"]
        assert target.startswith(reply.strip()[:20]), (target, reply)  # the mask covers the server's answer
        assert recs[r["id"]]["completion_tokens"] > 0 and recs[r["id"]]["finish_reason"] in ("stop", "length")


def test_regen_under_the_supervisor_end_to_end(tmp_path):
    """serve -> regen through the real supervisor: regen waits for ready, the server is stopped after."""
    make_prompts(tmp_path / "prompts", 4)
    run = make_run(tmp_path, PLAN.format(port=0, prompts=tmp_path / "prompts"))
    sup = start_supervisor(run)
    try:
        st = wait_done(run, timeout=420)
    finally:
        stop(sup)
    assert st == {"serve": "succeeded", "regen.toy": "succeeded"}, run.stage("regen.toy").log.read_text()[
        -3000:
    ]
    serve_events = read_all(run.stage("serve").events)
    assert [e.get("state") for e in serve_events if e.type == "health"] == ["starting", "ready", "stopped"]
    regen_started = next(e.t for e in read_all(run.stage("regen.toy").events) if e.type == "started")
    ready_t = next(e.t for e in serve_events if e.type == "health" and e.get("state") == "ready")
    assert regen_started >= ready_t  # the user only started once the server was ready
    pgid = json.loads(run.stage("serve").proc.read_text())["pgid"]
    assert group_members(pgid) == []  # the server is gone with its stage
    out = run.stage("regen.toy").out
    assert sorted(answered(out)) == [f"r{i:03d}" for i in range(4)]
    check_tokenized(out, 4)
    assert "Uvicorn running on" in run.stage("serve").log.read_text()  # the server's log pane


def test_sigterm_mid_run_then_retry_asks_each_record_once(tmp_path, cpu_server):
    n = 8
    prompts_dir(tmp_path, n)
    proxy = CountingProxy(cpu_server.url)
    out = tmp_path / "out"
    try:
        p1 = run_regen(tmp_path, proxy.url, out)
        wait_for(lambda: len(answered(out)) >= 3 or p1.poll() is not None, 240, "3 answers")
        os.killpg(p1.pid, signal.SIGTERM)  # as the supervisor's kill does
        assert p1.wait(timeout=150) == 128 + signal.SIGTERM
        first = answered(out)
        assert 3 <= len(first) < n and messages(out, "stopped") and not messages(out, "abandoned")
        p2 = run_regen(tmp_path, proxy.url, out)
        assert p2.wait(timeout=300) == 0, (tmp_path / "regen.err").read_text()[-3000:]
    finally:
        proxy.close()
    ids = answered(out)
    assert sorted(ids) == [f"r{i:03d}" for i in range(n)] and len(ids) == len(
        set(ids)
    )  # none lost, none twice
    assert proxy.counts == {prompt_text(i): 1 for i in range(n)}  # the server saw each prompt exactly once
    start2 = messages(out, "regen-start")[-1].get("text")
    assert f"{len(first)} already answered, {n - len(first)} to ask" in start2
    check_tokenized(out, n)


def test_sigkill_mid_run_repeats_only_unanswered_records(tmp_path, cpu_server):
    n = 6
    prompts_dir(tmp_path, n)
    proxy = CountingProxy(cpu_server.url)
    out = tmp_path / "out"
    try:
        p1 = run_regen(tmp_path, proxy.url, out)
        wait_for(lambda: len(answered(out)) >= 2 or p1.poll() is not None, 240, "2 answers")
        os.killpg(p1.pid, signal.SIGKILL)
        p1.wait(timeout=30)
        at_kill = set(answered(out))
        p2 = run_regen(tmp_path, proxy.url, out)
        assert p2.wait(timeout=300) == 0, (tmp_path / "regen.err").read_text()[-3000:]
    finally:
        proxy.close()
    ids = answered(out)
    assert sorted(ids) == [f"r{i:03d}" for i in range(n)] and len(ids) == len(set(ids))
    twice = {t for t, c in proxy.counts.items() if c > 1}
    answered_texts = {prompt_text(int(r[1:])) for r in at_kill}
    assert not twice & answered_texts  # nothing answered before the kill was asked again
    assert (
        len(twice) <= 2 and max(proxy.counts.values()) <= 2
    )  # at most the requests in flight (concurrency 2)


def test_server_killed_mid_run_client_retries_and_reports_outage(tmp_path):
    n = 6
    prompts_dir(tmp_path, n)
    port = free_port()
    plan = write_plan(tmp_path, PLAN.format(port=port, prompts=tmp_path / "prompts"))
    srv = Server(plan, tmp_path / "serve1")
    out = tmp_path / "out"
    srv2 = None
    try:
        p = run_regen(tmp_path, srv.url, out)
        wait_for(lambda: len(answered(out)) >= 2 or p.poll() is not None, 240, "2 answers")
        os.kill(srv.endpoint["pid"], signal.SIGKILL)  # the server process dies mid-run
        assert srv.proc.wait(timeout=30) == 1  # its stage notices and reports it
        wait_for(lambda: messages(out, "server-outage"), 60, "the client to report the outage")
        assert p.poll() is None  # the client waits, it does not give up
        srv2 = Server(plan, tmp_path / "serve2")  # same port
        assert p.wait(timeout=300) == 0, (tmp_path / "regen.err").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        srv.stop()
        if srv2 is not None:
            srv2.stop()
    outage = messages(out, "server-outage")
    assert len(outage) == 1 and outage[0].get("level") == "warning"
    assert "server unreachable" in outage[0].get("text")
    assert messages(out, "server-recovered")
    ids = answered(out)
    assert sorted(ids) == [f"r{i:03d}" for i in range(n)] and len(ids) == len(set(ids))
    assert not [f for f in (out / "errors.jsonl").read_text().splitlines() if f.strip()]
