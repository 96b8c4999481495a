"""The online bench (``[bench] engine = "sglang"``): the speedup table a run ends with, batch by batch.

SGLang cannot run on this machine (no GPU), so these tests drive ``FakeSGLang``, a named stand-in that speaks the
two things the bench reads from a real SGLang 0.5.x server: ``/generate``'s ``meta_info`` (``completion_tokens``,
``spec_verify_ct``) and ``/metrics``' Prometheus counters (``sglang:generation_tokens_total``,
``sglang:spec_verify_calls_total``, labelled per model as SGLang labels them). The real server ran this mode on the
lent H200 (docs/performance.md, "SGLang on the lent H200").
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.run.plan.dag import load as load_plan
from pipeline.run.plan.schema import PlanError
from pipeline.run.stage_side.runtime import StageContext
from pipeline.stages.bench.online import run_online
from tests.eagle3_fixtures import MODEL, write_plan, write_tokenized


class FakeSGLang:
    """A stand-in for an SGLang server (none can run without a GPU): each request takes ``delay_s`` and yields
    ``max_new_tokens`` tokens in ``ceil(n / accept)`` verify steps; counters start high, as on a server that
    has served before, so only their deltas give this measurement's accept length."""

    def __init__(self, accept: float | None, metrics: bool = True, delay_s: float = 0.01) -> None:
        self.accept, self.metrics, self.delay_s = accept, metrics, delay_s
        self.gen, self.verify = 5000.0, 4000.0  # a cumulative average of 1.25, whatever this run does
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/metrics" or not fake.metrics:
                    self.send_error(404)
                    return
                with fake.lock:
                    body = (
                        "# TYPE sglang:generation_tokens_total counter\n"
                        f'sglang:generation_tokens_total{{model_name="t"}} {fake.gen}\n'
                        f'sglang:spec_verify_calls_total{{model_name="t"}} {fake.verify}\n'
                    ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = int(req["sampling_params"]["max_new_tokens"])
                assert req["input_ids"] and req["sampling_params"]["temperature"] == 0.0
                with fake.lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                time.sleep(fake.delay_s)
                meta: dict = {"completion_tokens": n}
                with fake.lock:
                    fake.in_flight -= 1
                    fake.gen += n
                    if fake.accept is not None:
                        steps = math.ceil(n / fake.accept)
                        meta["spec_verify_ct"] = steps
                        fake.verify += steps
                body = json.dumps({"text": "", "meta_info": meta}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _bench(tmp_path: Path, label: str, url: str, baseline: str | None = None, **bench: object) -> dict:
    store = tmp_path / "prep"
    if not store.exists():
        write_tokenized(store, n=24)
    plan = write_plan(
        tmp_path / "plan.toml",
        MODEL,  # nothing loads it: the server holds the target
        bench={"engine": "sglang", "holdout": 0.5, "prompts": 4, "max_new_tokens": 20, **bench},
    )
    out = tmp_path / label / "out"  # as in a run dir: stages/<id>/out, how a baseline is found among inputs
    ctx = StageContext(label, out, out / "events.jsonl", plan)
    args = argparse.Namespace(label=label, url=url, baseline=baseline)
    inputs = [store] + ([tmp_path / baseline / "out"] if baseline else [])
    assert run_online(ctx, inputs, args) == 0
    return json.loads((out / "results.json").read_text())


def test_each_batch_is_measured_with_that_many_streams_and_the_counters_deltas(tmp_path: Path) -> None:
    plain, eagle = FakeSGLang(accept=None, metrics=False), FakeSGLang(accept=2.5)
    try:
        base = _bench(tmp_path, "plain", plain.url, batches=[1, 4], requests_per_stream=2)
        assert plain.max_in_flight == 4  # closed-loop streams: the server saw the batch, never more
        res = _bench(tmp_path, "eagle3", eagle.url, baseline="plain", batches=[1, 4], requests_per_stream=2)
    finally:
        plain.close()
        eagle.close()
    assert [r["batch"] for r in base["batches"]] == [1, 4]
    assert [r["requests"] for r in base["batches"]] == [2, 8]
    assert all(r["accept_len"] is None for r in base["batches"])  # no draft: nothing to accept
    rows = res["batches"]
    # 20 tokens in ceil(20 / 2.5) = 8 verify steps: 2.5 from the deltas, not the counters' 1.25 history
    assert [r["accept_len_counters"] for r in rows] == [pytest.approx(2.5), pytest.approx(2.5)]
    assert [r["accept_len_responses"] for r in rows] == [pytest.approx(2.5), pytest.approx(2.5)]
    for r, b in zip(rows, base["batches"], strict=True):
        assert r["baseline_tok_s"] == pytest.approx(b["output_tok_s"])
        assert r["speedup"] == pytest.approx(r["output_tok_s"] / b["output_tok_s"])
        assert r["completion_tokens"] == 20 * r["requests"]
    assert res["speedup"] == rows[0]["speedup"] and res["baseline"]["label"] == "plain"
    said = [
        json.loads(line).get("text", "")
        for line in (tmp_path / "eagle3" / "out" / "events.jsonl").read_text().splitlines()
    ]
    table = [t for t in said if t.startswith("eagle3 batch ")]
    assert (
        len(table) == 2 and "x plain's" in table[1] and "accept length 2.50 (SGLang's counters)" in table[1]
    )


def test_without_metrics_the_accept_length_comes_from_the_responses(tmp_path: Path) -> None:
    eagle = FakeSGLang(accept=2.0, metrics=False)
    try:
        res = _bench(tmp_path, "eagle3", eagle.url, batches=[2], requests_per_stream=1)
    finally:
        eagle.close()
    (row,) = res["batches"]
    assert row["accept_len_counters"] is None and row["accept_len"] == pytest.approx(2.0)


def test_engine_and_mode_that_disagree_are_named(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.toml", MODEL, bench={"engine": "transformers", "mode": "online"})
    with pytest.raises(PlanError, match="bench.engine"):
        load_plan(plan)
    plan = write_plan(tmp_path / "plan.toml", MODEL, bench={"engine": "sglang", "batches": []})
    with pytest.raises(PlanError, match="bench.batches"):
        load_plan(plan)
    assert load_plan(
        write_plan(tmp_path / "plan.toml", MODEL, bench={"engine": "sglang"})
    ).settings.bench.online


def test_a_bench_after_only_its_baseline_sends_the_baselines_prompts(tmp_path: Path) -> None:
    """docs/eagle3.md's plan: bench-eagle3 runs ``after = ["bench-plain"]``, so its only input is the baseline's out
    dir (no shards, no draft). It must send the prompts the baseline measured (found on the H200: it had none)."""
    plain, eagle = FakeSGLang(accept=None, metrics=False), FakeSGLang(accept=2.0)
    try:
        _bench(tmp_path, "plain", plain.url, batches=[1], requests_per_stream=1)
        out = tmp_path / "eagle3" / "out"
        ctx = StageContext("eagle3", out, out / "events.jsonl", tmp_path / "plan.toml")
        args = argparse.Namespace(label="eagle3", url=eagle.url, baseline="plain")
        assert run_online(ctx, [tmp_path / "plain" / "out"], args) == 0
    finally:
        plain.close()
        eagle.close()
    sent = json.loads((out / "prompts.json").read_text())
    assert sent and sent == json.loads((tmp_path / "plain" / "out" / "prompts.json").read_text())
    assert json.loads((out / "results.json").read_text())["batches"][0]["speedup"] > 0


def test_a_served_accept_length_below_the_trained_one_is_recorded_with_both_sources(tmp_path: Path) -> None:
    """Issue 44 item 10 on the online path: the bench puts SGLang's accept length beside the train stage's
    simulated one for the draft it serves, in results.json and as the ``accept-gap`` message the rule reads."""
    from pipeline.manifests import train as train_manifest
    from pipeline.manifests.train import DraftManifest

    plain, eagle = FakeSGLang(accept=None, metrics=False), FakeSGLang(accept=2.0)
    train_out = tmp_path / "train" / "out"
    train_out.mkdir(parents=True)
    man = DraftManifest(kind="draft", aux_layer_ids=(1, 2, 3), step=200, accept_length=2.72)
    train_manifest.write(train_out / "manifest.json", man)
    try:
        base = _bench(tmp_path, "plain", plain.url, batches=[1])
        assert "accept_gap" not in base, "the plain server serves no draft"
        out = tmp_path / "eagle3" / "out"
        ctx = StageContext("eagle3", out, out / "events.jsonl", tmp_path / "plan.toml")
        args = argparse.Namespace(label="eagle3", url=eagle.url, baseline="plain")
        assert run_online(ctx, [tmp_path / "plain" / "out", train_out], args) == 0
    finally:
        plain.close()
        eagle.close()
    gap = json.loads((out / "results.json").read_text())["accept_gap"]
    assert gap["served"] == pytest.approx(2.0) and gap["simulated"] == pytest.approx(2.72)
    assert gap["gap"] == pytest.approx((2.72 - 2.0) / 2.72, abs=1e-3)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (said,) = [e for e in events if e.get("code") == "accept-gap"]
    assert "2.000 here vs 2.720 simulated in training for the same draft (26.5% lower)" in said["text"]
    assert str(out / "results.json") in json.dumps(said) and str(train_out) in json.dumps(said)
