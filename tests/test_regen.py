"""Regeneration pieces: the resumable answer log, plan and input errors, and the client's retry rules
against a real loopback HTTP server that answers 503 / 400 / drops connections on purpose."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest
from aiohttp import web

from pipeline.data.shard_writer import ShardStore, prompt_table
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import PlanError
from pipeline.stages.regen.client import ClientConfig, OutageError, Regenerator, parse_reply
from pipeline.stages.regen.stage import InputError, read_prompts, regen_settings
from pipeline.stages.regen.store import ResponseLog


def make_prompts(d: Path, n: int, ids: list[str] | None = None) -> Path:
    ids = ids or [f"r{i:03d}" for i in range(n)]
    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    st = ShardStore(d, {"stage": "test"})
    rec = st.commit(0, prompt_table(ids, convs), {})
    st.write_manifest("prompts", [rec], dataset="toy")
    return d


# -------------------------------------------------------------------------------- answer log
def test_response_log_resumes_and_repairs_a_torn_line(tmp_path):
    p = tmp_path / "responses.jsonl"
    log = ResponseLog(p)
    log.append({"id": "a", "messages": []})
    log.append({"id": "b", "messages": []})
    log.append({"id": "a", "messages": ["second answer"]})  # never two answers for one record
    log.close()
    with open(p, "ab") as fh:
        fh.write(b'{"id": "c", "mess')  # a kill in the middle of a write
    log2 = ResponseLog(p)
    assert log2.repaired_bytes == len(b'{"id": "c", "mess')
    assert "a" in log2 and "b" in log2 and "c" not in log2 and len(log2) == 2
    log2.append({"id": "c", "messages": []})
    log2.close()
    lines = p.read_text().splitlines()
    assert [json.loads(ln)["id"] for ln in lines] == ["a", "b", "c"]


def test_response_log_names_a_corrupt_line(tmp_path):
    p = tmp_path / "responses.jsonl"
    p.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"responses.jsonl: line 2: not an answer record"):
        ResponseLog(p)


# ------------------------------------------------------------------------------ plan / inputs
def plan_with(tmp_path: Path, regen: str) -> plan_mod.Plan:
    p = tmp_path / "plan.toml"
    p.write_text(
        textwrap.dedent("""
        [run]
        dir = "run"
        [target]
        model = "builtin:smollm2-135m-instruct"
        [regen]
    """)
        + textwrap.dedent(regen)
    )
    return plan_mod.load(p)


@pytest.mark.parametrize(
    "body,key,words",
    [
        ("concurrency = 0", "regen.concurrency", "must be > 0"),
        ('temperature = "hot"', "regen.temperature", "expected a number"),
        ("max_token = 5", "regen.max_token", "unknown key"),
        ("drop_truncated = 1", "regen.drop_truncated", "expected true or false"),
        ("max_error_fraction = 2", "regen.max_error_fraction", "between 0 and 1"),
    ],
)
def test_regen_plan_errors_name_the_key(tmp_path, body, key, words):
    with pytest.raises(PlanError) as ei:
        regen_settings(plan_with(tmp_path, body))
    assert f": {key}: " in str(ei.value) and words in str(ei.value)


def test_regen_settings_defaults_and_sampling(tmp_path):
    s = regen_settings(plan_with(tmp_path, "temperature = 0.2\nmax_tokens = 32\nextra = {top_k = 20}"))
    assert s.concurrency == 64
    assert s.sampling_body() == {"temperature": 0.2, "max_tokens": 32, "top_k": 20}


def test_read_prompts_errors_name_file_row_field(tmp_path):
    d = make_prompts(tmp_path / "p", 3, ids=["x", "y", "x"])
    with pytest.raises(InputError, match=r"data-00000.parquet: row 2: id: duplicate id 'x'"):
        read_prompts(d)
    st = ShardStore(tmp_path / "q", {"stage": "test"})
    rec = st.commit(
        0,
        prompt_table(["a"], [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]),
        {},
    )
    st.write_manifest("prompts", [rec])
    with pytest.raises(InputError, match=r"row 0 \(id a\): messages: expected turns ending with a user turn"):
        read_prompts(tmp_path / "q")
    assert [rid for rid, _ in read_prompts(make_prompts(tmp_path / "r", 5), limit=2)] == ["r000", "r001"]


def test_parse_reply_keeps_reasoning_finish_reason_and_tokens():
    body = {
        "model": "m",
        "choices": [
            {
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"},
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    rec = parse_reply("r1", [{"role": "user", "content": "2+2?"}], body, "m")
    assert rec["messages"][-1] == {"role": "assistant", "content": "4", "reasoning": "2+2 is 4"}
    assert (rec["finish_reason"], rec["prompt_tokens"], rec["completion_tokens"]) == ("stop", 7, 3)


# --------------------------------------------------------------------- retry rules over HTTP
class Flaky:
    """A real loopback chat-completions server whose behaviour per prompt is scripted."""

    def __init__(self, script: dict[str, list[int]]) -> None:
        self.script = script  # prompt text -> statuses to answer in turn (200 = a real answer)
        self.calls: dict[str, int] = {}

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "flaky-model"}]})

    async def chat(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        text = body["messages"][-1]["content"]
        n = self.calls.get(text, 0)
        self.calls[text] = n + 1
        seq = self.script.get(text, [200])
        status = seq[min(n, len(seq) - 1)]
        assert body["model"] == "flaky-model" and body["max_tokens"] == 5
        if status == 200:
            return web.json_response(
                {
                    "model": "flaky-model",
                    "choices": [
                        {
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"answer to {text}"},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                }
            )
        return web.json_response({"error": "scripted"}, status=status)


async def serve_app(flaky: Flaky, port: int = 0) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/v1/models", flaky.models)
    app.router.add_post("/v1/chat/completions", flaky.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def cfg(port: int, **kw) -> ClientConfig:
    base = {
        "concurrency": 4,
        "max_attempts": 3,
        "backoff_s": 0.01,
        "backoff_max_s": 0.05,
        "request_timeout_s": 10,
        "sampling": {"max_tokens": 5},
    }
    return ClientConfig(url=f"http://127.0.0.1:{port}", **{**base, **kw})


async def test_5xx_is_retried_and_4xx_is_not():
    flaky = Flaky({"q-503": [503, 502, 200], "q-400": [400], "q-dead": [500]})
    runner, port = await serve_app(flaky)
    got, failed = {}, {}
    try:
        r = Regenerator(
            cfg(port),
            lambda rec: got.__setitem__(rec["id"], rec),
            on_failure=lambda rid, why: failed.__setitem__(rid, why),
        )
        prompts = [(t, [{"role": "user", "content": t}]) for t in ("q-ok", "q-503", "q-400", "q-dead")]
        stats = await r.run(prompts)
    finally:
        await runner.cleanup()
    assert set(got) == {"q-ok", "q-503"}
    assert got["q-503"]["messages"][-1]["content"] == "answer to q-503"
    assert flaky.calls == {
        "q-ok": 1,
        "q-503": 3,
        "q-400": 1,
        "q-dead": 3,
    }  # max_attempts 3, 400 never repeated
    assert failed["q-400"].startswith("HTTP 400") and "gave up after 3 attempts: HTTP 500" in failed["q-dead"]
    assert (stats.answered, stats.failed, stats.retries, stats.sent) == (2, 2, 4, 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_outage_waits_without_using_attempts_and_reports_it():
    import asyncio

    port = free_port()
    flaky = Flaky({})
    outages: list[tuple[bool, float]] = []
    got: list[str] = []
    r = Regenerator(
        cfg(port, max_attempts=1, backoff_max_s=0.1),
        lambda rec: got.append(rec["id"]),
        on_outage=lambda start, detail, dur: outages.append((start, dur)),
    )
    prompts = [(f"p{i}", [{"role": "user", "content": f"p{i}"}]) for i in range(6)]
    task = asyncio.create_task(r.run(prompts))
    await asyncio.sleep(0.5)  # nothing listens yet: connection refused, over and over
    assert outages == [(True, 0.0)] and not got
    runner, _ = await serve_app(flaky, port)
    try:
        stats = await asyncio.wait_for(task, 20)
    finally:
        await runner.cleanup()
    assert sorted(got) == [f"p{i}" for i in range(6)]  # none lost, though max_attempts is 1
    assert len(outages) == 2 and outages[1][0] is False and outages[1][1] >= 0.4
    assert stats.outages == 1 and stats.failed == 0


async def test_a_long_outage_fails_with_a_clear_error():
    r = Regenerator(cfg(free_port(), outage_timeout_s=0.3, backoff_max_s=0.05), lambda rec: None)
    with pytest.raises(OutageError, match=r"unreachable for \d+s \(> 0.3s\)"):
        await r.run([("a", [{"role": "user", "content": "a"}])])


# --------------------------------------------------------------------- prompts over max_length
@pytest.mark.slow
def test_prompts_that_fill_max_length_are_not_sent(tmp_path):
    """A prompt that alone fills target.max_length could train on no answer token: it is never requested,
    and too many of them fail the stage before any request (here nothing even listens on the port)."""
    import os
    import subprocess
    import sys

    from pipeline.data.tokenise import load_chat_tokenizer
    from pipeline.stages.regen.stage import split_by_length
    from tests.runs import ROOT

    ct = load_chat_tokenizer("builtin:smollm2-135m-instruct", 64)
    short = ("s", [{"role": "user", "content": "hi"}])
    long_ = ("l", [{"role": "user", "content": "word " * 80}])
    fit, too_long = split_by_length(ct, [short, long_])
    assert fit == [short] and too_long[0][0] == "l" and too_long[0][1] >= 64

    st = ShardStore(tmp_path / "p", {"stage": "test"})
    rec = st.commit(
        0,
        prompt_table(
            ["a", "b", "c"],
            [[{"role": "user", "content": t}] for t in ("short question", "word " * 80, "word " * 90)],
        ),
        {},
    )
    st.write_manifest("prompts", [rec])
    plan = tmp_path / "plan.toml"
    plan.write_text(
        textwrap.dedent("""
        [run]
        dir = "run"
        [target]
        model = "builtin:smollm2-135m-instruct"
        max_length = 64
        [[datasets]]
        name = "toy"
        source = "local"
        kind = "prompt-only"
        quota = 3
        [regen]
        outage_timeout_s = 5
    """)
    )
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.stages.regen",
            "--plan",
            str(plan),
            "--dataset",
            "toy",
            "--input",
            str(tmp_path / "p"),
            "--out",
            str(out),
            "--server-url",
            f"http://127.0.0.1:{free_port()}",
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    evs = [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines()]
    err = [e["text"] for e in evs if e["type"] == "message" and e.get("level") == "error"]
    assert len(err) == 1 and "2 of 3 prompts are" in err[0] and "target.max_length 64" in err[0]
    assert "regen.max_skipped_fraction 0.5" in err[0]
    assert not any(e.get("code") == "server-outage" for e in evs)  # no request was attempted


async def test_pause_holds_new_requests_and_is_acknowledged():
    import asyncio

    flaky = Flaky({})
    runner, port = await serve_app(flaky)
    state = {"paused": True}
    acks: list[bool] = []
    got: list[str] = []
    try:
        r = Regenerator(
            cfg(port, concurrency=2),
            lambda rec: got.append(rec["id"]),
            paused=lambda: state["paused"],
            on_pause=acks.append,
        )
        task = asyncio.create_task(
            r.run([(f"q{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(4)])
        )
        await asyncio.sleep(0.8)
        assert acks == [True] and flaky.calls == {} and not got  # paused at a safe point: nothing sent
        state["paused"] = False
        await asyncio.wait_for(task, 20)
    finally:
        await runner.cleanup()
    assert acks == [True, False] and sorted(got) == ["q0", "q1", "q2", "q3"]


async def test_requests_are_spread_over_every_replica_of_the_server():
    """serve with replicas = N (Slurm): regen sends to each server in turn."""
    a, b = Flaky({}), Flaky({})
    (ra, pa), (rb, pb) = await serve_app(a), await serve_app(b)
    got = {}
    try:
        r = Regenerator(
            cfg(pa, more_urls=(f"http://127.0.0.1:{pb}",)), lambda rec: got.__setitem__(rec["id"], rec)
        )
        await r.run([(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(10)])
    finally:
        await ra.cleanup()
        await rb.cleanup()
    assert len(got) == 10
    assert sum(a.calls.values()) == 5 and sum(b.calls.values()) == 5
