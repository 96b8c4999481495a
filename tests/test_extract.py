"""Extraction: captured layers and shapes against the real model, resume by shard, online mode, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.shards import Row, is_heldout, iter_rows
from pipeline.eagle3 import hidden_store as hs
from pipeline.stages.extract import length_batches, plan_shards
from tests.eagle3_fixtures import (
    HIDDEN,
    ROOT,
    events,
    metrics,
    run_stage,
    shared,
    tiny_llama,
    write_plan,
    write_tokenized,
)


def _row(i: int, n: int) -> Row:
    return Row(f"r{i}", np.zeros(n, np.int32), np.ones(n, np.int8), "x")


def test_length_batches_respect_the_padded_budget() -> None:
    rows = [_row(i, n) for i, n in enumerate([90, 10, 55, 40, 40, 12, 70, 5])]
    shards = plan_shards(rows, 150)
    flat = [r for s in shards for r in s]
    assert [r.num_tokens for r in flat] == sorted((r.num_tokens for r in rows), reverse=True)
    assert all(sum(r.num_tokens for r in s) <= 150 or len(s) == 1 for s in shards)
    for s in shards:
        for b in length_batches(s, 100):
            assert max(r.num_tokens for r in b) * len(b) <= 100 or len(b) == 1


@pytest.mark.slow
def test_extraction_captures_the_aux_layers_and_targets(tmp_path_factory) -> None:
    from pipeline.data.model_assets import load_model

    out = shared(tmp_path_factory, "ext")
    tok = shared(tmp_path_factory, "tok")
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "hidden_states" and man["mode"] == "offline"
    assert man["aux_layer_ids"] == [1, 14, 26] and man["hidden_size"] == HIDDEN
    train_rows = {r.id: r for r in iter_rows([tok], 0.2, "train")}
    assert man["rows"] == len(train_rows) and man["tokens"] == sum(r.num_tokens for r in train_rows.values())

    store = hs.HiddenStore(out)
    stored_ids = []
    for s in man["shards"]:
        from safetensors import safe_open

        with safe_open(str(out / s["file"]), framework="pt") as f:
            stored_ids += json.loads(f.metadata()["ids"])
    assert sorted(stored_ids) == sorted(train_rows)  # every training row once, no held-out row
    assert not any(is_heldout(i, 0.2) for i in stored_ids)

    model = load_model(tiny_llama()).eval()
    for i in (0, len(store) - 1):
        s = store[i]
        row = train_rows[stored_ids[i]]
        n = row.num_tokens
        assert s.aux.shape == (n, 3 * HIDDEN) and s.aux.dtype == torch.bfloat16
        assert s.last_hidden.shape == (n, HIDDEN) and s.target_argmax.shape == (n,)
        assert np.array_equal(s.input_ids.numpy(), row.input_ids) and np.array_equal(
            s.loss_mask.numpy(), row.loss_mask
        )
        with torch.no_grad():
            o = model(torch.from_numpy(row.input_ids.astype("int64"))[None], output_hidden_states=True)
        for k, layer in enumerate((1, 14, 26)):  # hidden_states[l + 1] is the output of layer l
            ref = o.hidden_states[layer + 1][0]
            got = s.aux[:, k * HIDDEN : (k + 1) * HIDDEN].float()
            assert (got - ref).norm() / ref.norm() < 1e-2, layer
        assert (s.last_hidden.float() - o.hidden_states[-1][0]).norm() / o.hidden_states[-1][0].norm() < 1e-2
        agree = (s.target_argmax.long() == o.logits[0].argmax(-1)).float().mean()
        assert agree > 0.98


@pytest.mark.slow
def test_extraction_reports_projected_and_actual_bytes(tmp_path_factory) -> None:
    out = shared(tmp_path_factory, "ext")
    man = json.loads((out / "manifest.json").read_text())
    proj = metrics(out, "projected_bytes")
    act = metrics(out, "actual_bytes")
    # the held-out rows training measures acceptance on are stored too, and counted in the budget
    assert man["eval_rows"] > 0 and man["eval_shards"]
    assert proj[0].get("value") == (man["tokens"] + man["eval_tokens"]) * hs.bytes_per_token(HIDDEN, 3)
    assert (
        act[-1].get("value")
        == man["bytes"]
        == sum((out / s["file"]).stat().st_size for s in man["shards"] + man["eval_shards"])
    )
    assert abs(man["bytes"] - proj[0].get("value")) / proj[0].get("value") < 0.05  # headers only
    assert metrics(out, "tokens_per_s") and len(man["shards"]) > 1


@pytest.mark.slow
def test_extraction_resumes_shard_by_shard_after_a_kill(tmp_path_factory, tmp_path) -> None:
    tok = shared(tmp_path_factory, "tok")
    plan = write_plan(
        tmp_path / "plan.toml", extract={"shard_tokens": 250, "batch_tokens": 300}, bench={"holdout": 0.2}
    )
    out = tmp_path / "ext"
    argv = [
        sys.executable,
        "-m",
        "pipeline.stages.extract",
        "--plan",
        str(plan),
        "--out",
        str(out),
        "--input",
        str(tok),
    ]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / "extract-state.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if state.is_file() and len(json.loads(state.read_text())["done"]) >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, "extraction finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    done_before = json.loads(state.read_text())["done"]
    assert not (out / "manifest.json").exists()
    stamps = {name: (out / name).stat().st_mtime_ns for name in done_before}
    run_stage("pipeline.stages.extract", plan, out, [tok])
    for name, ns in stamps.items():
        assert (out / name).stat().st_mtime_ns == ns, f"{name} was extracted twice"
    msgs = [e.get("text") for e in events(out) if e.type == "message"]
    assert any(f"resuming with {len(done_before)} shards done" in m for m in msgs)
    man = json.loads((out / "manifest.json").read_text())
    assert man["rows"] == len(list(iter_rows([tok], 0.2, "train")))
    assert sum(s["rows"] for s in man["shards"]) == man["rows"] and len(man["shards"]) > len(done_before)
    assert len(hs.HiddenStore(out)) == man["rows"]


@pytest.mark.slow
def test_device_auto_places_the_target_with_accelerate_and_stores_the_same(
    tmp_path_factory, tmp_path
) -> None:
    from tests.eagle3_fixtures import TEST_SECTIONS

    tok, ref = shared(tmp_path_factory, "tok"), shared(tmp_path_factory, "ext")
    sections = {**TEST_SECTIONS, "extract": {**TEST_SECTIONS["extract"], "device": "auto"}}
    run_stage(
        "pipeline.stages.extract", write_plan(tmp_path / "plan.toml", **sections), tmp_path / "ext", [tok]
    )
    a, b = hs.HiddenStore(ref), hs.HiddenStore(tmp_path / "ext")
    assert len(a) == len(b)
    for i in (0, len(a) - 1):
        assert torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].target_argmax, b[i].target_argmax)


@pytest.mark.slow
def test_online_mode_stores_nothing(tmp_path_factory, tmp_path) -> None:
    tok = shared(tmp_path_factory, "tok")
    plan = write_plan(tmp_path / "plan.toml", extract={"mode": "online"}, bench={"holdout": 0.2})
    run_stage("pipeline.stages.extract", plan, tmp_path / "ext", [tok])
    man = json.loads((tmp_path / "ext" / "manifest.json").read_text())
    assert man["mode"] == "online" and man["bytes"] == 0 and man["shards"] == []
    assert man["sources"] == [str(tok)] and man["tokens"] > 0
    assert metrics(tmp_path / "ext", "projected_bytes")[0].get("value") == 0
    assert not list((tmp_path / "ext").glob("hs-*"))


@pytest.mark.slow
def test_a_bad_row_is_named_by_file_row_and_field(tmp_path) -> None:
    tok = write_tokenized(tmp_path / "tok", n=4, rows_per_shard=4)
    shard = tok / "shard-00000.parquet"
    t = pq.read_table(shard).to_pylist()
    t[2]["loss_mask"] = t[2]["loss_mask"][:-3]
    pq.write_table(pa.Table.from_pylist(t, schema=pq.read_schema(shard)), shard)
    plan = write_plan(tmp_path / "plan.toml", bench={"holdout": 0.0})
    p = run_stage("pipeline.stages.extract", plan, tmp_path / "ext", [tok], check=False)
    assert p.returncode != 0
    assert "shard-00000.parquet: row 2 (id='row-0002'): loss_mask has" in p.stderr


@pytest.mark.slow
def test_the_stored_shards_are_what_the_synchronous_write_path_stored_from_the_same_rows(
    tmp_path_factory, tmp_path
) -> None:
    """The writer thread and pinned-buffer path against the old one: capture, one host copy per row, write_shard."""
    from safetensors import safe_open

    from pipeline.eagle3.target_capture import load_target
    from pipeline.stages.extract import capture_batch
    from tests.eagle3_fixtures import TEST_SECTIONS
    from tests.test_shard_sink import tensor_digests

    out, tok = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "tok")
    man = json.loads((out / "manifest.json").read_text())
    train_rows = {r.id: r for r in iter_rows([tok], 0.2, "train")}
    target = load_target(tiny_llama(), man["aux_layer_ids"])
    for s in man["shards"]:
        with safe_open(str(out / s["file"]), framework="pt") as f:
            ids = json.loads(f.metadata()["ids"])
        captured = []
        for batch in length_batches([train_rows[i] for i in ids], TEST_SECTIONS["extract"]["batch_tokens"]):
            cap, am = capture_batch(target, batch)
            captured += [
                {
                    "aux": cap.aux[i, : r.num_tokens].to("cpu", torch.bfloat16),
                    "last_hidden": cap.last_hidden[i, : r.num_tokens].to("cpu", torch.bfloat16),
                    "target_argmax": am[i, : r.num_tokens].to("cpu", torch.int32),
                    "input_ids": torch.from_numpy(r.input_ids),
                    "loss_mask": torch.from_numpy(r.loss_mask),
                }
                for i, r in enumerate(batch)
            ]
        hs.write_shard(tmp_path / s["file"], captured, ids)
        assert tensor_digests(out / s["file"]) == tensor_digests(tmp_path / s["file"]), s["file"]


@pytest.mark.slow
def test_a_shard_that_cannot_be_written_fails_the_stage_naming_it_and_a_retry_completes(
    tmp_path_factory, tmp_path
) -> None:
    from safetensors import safe_open

    tok = shared(tmp_path_factory, "tok")
    plan = write_plan(
        tmp_path / "plan.toml", extract={"shard_tokens": 250, "batch_tokens": 300}, bench={"holdout": 0.2}
    )
    out = tmp_path / "ext"
    blocker = out / "hs-00002.safetensors.partial"
    blocker.mkdir(parents=True)  # a directory where the third shard's file must go: even root cannot write it
    p = run_stage("pipeline.stages.extract", plan, out, [tok], check=False)
    assert p.returncode != 0
    said = f"writing shard {out / 'hs-00002.safetensors'}"
    assert said in p.stderr, p.stderr[-2000:]
    assert any(
        said in (e.get("text") or "")
        for e in events(out)
        if e.type == "message" and e.get("level") == "error"
    )
    done = json.loads((out / "extract-state.json").read_text())["done"]
    assert sorted(done) == ["hs-00000.safetensors", "hs-00001.safetensors"]
    for name, rec in done.items():  # the shards before the failure are whole and recorded
        assert (out / name).stat().st_size == rec["bytes"]
        with safe_open(str(out / name), framework="pt") as f:
            assert f.get_tensor("offsets").numel() - 1 == rec["rows"]
    assert not (out / "manifest.json").exists()
    stamps = {name: (out / name).stat().st_mtime_ns for name in done}
    blocker.rmdir()
    run_stage("pipeline.stages.extract", plan, out, [tok])
    for name, ns in stamps.items():
        assert (out / name).stat().st_mtime_ns == ns, f"{name} was extracted twice"
    man = json.loads((out / "manifest.json").read_text())
    assert len(hs.HiddenStore(out)) == man["rows"] == len(list(iter_rows([tok], 0.2, "train")))
    assert not list(out.glob("*.partial"))
