"""The prep stage as a program: validate first, quarantine, thresholds, outputs, no-op rerun, stale outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import sources
from pipeline.run.rundir.events import decode

ROOT = Path(__file__).resolve().parent.parent


def write_plan(tmp: Path, datasets: list[dict], prep: dict | None = None, max_length: int = 512) -> Path:
    prep = {"shard_rows": 8, "batch_rows": 8, "check_rows": 16, "reject_threshold": 0.25, **(prep or {})}
    lines = [
        "[run]",
        'name = "t"',
        f'dir = "{tmp / "run"}"',
        "[target]",
        'model = "builtin:smollm2-135m-instruct"',
        f"max_length = {max_length}",
        "[prep]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in prep.items()]
    for d in datasets:
        lines.append("[[datasets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in d.items() if k != "options"]
        if d.get("options"):
            lines.append("[datasets.options]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in d["options"].items()]
    lines += ["[[stage]]", 'id = "prep"', 'run = "prep"', 'for_each = "dataset"']
    path = tmp / "plan.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def ds(
    name: str,
    source: str | None = None,
    kind: str | None = None,
    quota: int = 24,
    path: str | None = None,
    **options: object,
) -> dict:
    src = sources.get(source or name)
    d = {
        "name": name,
        "source": src.key,
        "kind": kind or src.kind,
        "quota": quota,
        "path": path or str(src.fixture),
    }
    if options:
        d["options"] = options
    return d


def prep(plan: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pipeline.stages.prep", "--plan", str(plan), *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


def events(out: Path) -> list:
    return [decode(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_check_names_dataset_row_and_field_of_every_malformed_row_and_writes_nothing(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [ds("ultrachat"), ds("sharegpt")])
    r = prep(plan, "--check", "20")
    assert r.returncode == 1
    assert "ultrachat: row 6 (line 7): messages: empty list of turns" in r.stdout
    assert "ultrachat: row 13 (line 14): messages[1].content: expected text, got int" in r.stdout
    assert "sharegpt: row 2 (line 3): conversations[1].from: unknown role 'narrator'" in r.stdout
    assert "ultrachat: checked 20 rows: 18 valid, 2 malformed" in r.stdout
    assert not (tmp_path / "run").exists()
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(line for i, line in enumerate(sources.get("ultrachat").fixture.open()) if i < 6))
    r = prep(
        write_plan(tmp_path, [ds("ultrachat", path=str(clean))]), "--check", "20", "--dataset", "ultrachat"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checked 6 rows: 6 valid, 0 malformed" in r.stdout


def test_a_wrong_schema_stops_before_any_work_naming_row_and_field(tmp_path: Path) -> None:
    # UltraChat's normaliser pointed at the ShareGPT file: every row lacks `messages`
    plan = write_plan(tmp_path, [ds("ultrachat", path=str(sources.get("sharegpt").fixture))])
    out = tmp_path / "out"
    r = prep(plan, "--dataset", "ultrachat", "--out", str(out))
    assert r.returncode == 1
    assert (
        "ultrachat: validation of the first 16 rows failed: 16 malformed (100% > threshold 25%)" in r.stderr
    )
    assert "ultrachat: row 0 (line 1): messages: expected a list of turns, got nothing" in r.stderr
    assert not list(out.glob("data-*.parquet")) and not (out / "manifest.json").exists()


def test_prompt_only_run_writes_prompts_rejects_and_manifest(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [ds("sharegpt", quota=100)])
    out = tmp_path / "out"
    r = prep(plan, "--dataset", "sharegpt", "--out", str(out))
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "prompts" and man["dataset"] == "sharegpt"
    # 33 rows: 3 malformed + 1 without a user turn quarantined, 2 exact duplicates dropped
    assert (man["rows_read"], man["rows"], man["rejects"], man["duplicates"]) == (33, 27, 4, 2)
    assert [s["rows"] for s in man["shards"]] == [8, 8, 8, 3]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"]) for r in rejects] == [
        (2, "conversations[1].from"),
        (10, "conversations"),
        (17, "conversations[0].value"),
        (25, "conversations"),
    ]
    assert rejects[3]["reason"] == "no user turn to build a prompt from"
    table = pq.read_table(out / man["shards"][0]["file"])
    assert table.column_names == ["id", "messages"]
    first = table.to_pylist()[0]
    assert first["id"] == "sharegpt-0"
    assert first["messages"][-1]["role"] == "user"  # the prompt ends at the last user turn
    assert first["messages"][0] == {
        "role": "user",
        "content": "What are some good habits for staying focused while working from home?",
    }
    evs = events(out)
    prog = [e for e in evs if e.type == "progress"]
    assert prog[-1].data | {"rate": 0, "t": 0} == {
        "done": 27,
        "total": 100,
        "unit": "rows",
        "key": "sharegpt",
        "rate": 0,
        "read": 33,
        "rejects": 4,
        "duplicates": 2,
        "t": 0,
    }
    warned = [e for e in evs if e.type == "message" and e.get("code") == "reject"]
    assert [e.get("row") for e in warned] == [2, 10, 17, 25]
    assert any(e.type == "message" and e.get("code") == "short" for e in evs)  # quota 100, source ran out
    assert any(e.type == "metric" and e.get("name") == "rejects" and e.get("value") == 4 for e in evs)


@pytest.mark.slow
def test_target_native_run_writes_tokenized_shards_and_reruns_as_a_no_op(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [ds("kimik2-5-2000x", quota=24)])
    out = tmp_path / "out"
    r = prep(plan, "--dataset", "kimik2-5-2000x", "--out", str(out))
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "tokenized" and man["tokenizer"] == "builtin:smollm2-135m-instruct"
    assert man["max_length"] == 512 and len(man["template_hash"]) == 16
    assert (
        man["rows"] == 24 and man["rejects"] == 3 and man["dropped"] == 1
    )  # one reply starts past max_length
    table = pq.read_table(out / "data-00000.parquet")
    assert table.schema.field("input_ids").type.value_type == pa.int32()
    assert table.schema.field("loss_mask").type.value_type == pa.int8()
    assert table.schema.field("num_tokens").type == pa.int32()
    assert man["tokens"] == sum(
        sum(pq.read_table(out / s["file"]).column("num_tokens").to_pylist()) for s in man["shards"]
    )
    for row in table.to_pylist():
        assert 0 < sum(row["loss_mask"]) < len(row["input_ids"]) == row["num_tokens"] <= 512
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"]) for r in rejects] == [(5, "response"), (12, "thinking"), (21, "response")]
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != "events.jsonl"}
    r = prep(plan, "--dataset", "kimik2-5-2000x", "--out", str(out))
    assert r.returncode == 0
    assert "already prepared (24 rows in 3 shards); nothing to do" in r.stderr
    assert {
        p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != "events.jsonl"
    } == stamp


def test_changed_settings_refuse_the_old_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        prep(
            write_plan(tmp_path, [ds("magicoder-evol", quota=12)]),
            "--dataset",
            "magicoder-evol",
            "--out",
            str(out),
        ).returncode
        == 0
    )
    r = prep(
        write_plan(tmp_path, [ds("magicoder-evol", quota=12)], prep={"shard_rows": 5}),
        "--dataset",
        "magicoder-evol",
        "--out",
        str(out),
    )
    assert r.returncode == 1
    assert "made with different settings (shard_rows changed); retry the stage with --fresh" in r.stderr


@pytest.mark.slow
def test_a_reject_rate_above_the_threshold_fails_the_stage(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path, [ds("swe-agent", quota=100)], prep={"reject_threshold": 0.05, "check_rows": 4}
    )
    out = tmp_path / "out"
    r = prep(plan, "--dataset", "swe-agent", "--out", str(out))
    assert r.returncode == 1
    assert "swe-agent: 4 of 32 rows malformed (12.5%), above the threshold 5.0%" in r.stderr
    assert not (out / "manifest.json").exists()
    assert len((out / "rejects.jsonl").read_text().splitlines()) == 4
    # the operator accepts the rate for this dataset: the finished shards are reused
    plan = write_plan(
        tmp_path,
        [ds("swe-agent", quota=100, reject_threshold=0.2)],
        prep={"reject_threshold": 0.05, "check_rows": 4},
    )
    r = prep(plan, "--dataset", "swe-agent", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "resuming after 4 finished shards" in r.stderr


def test_bad_prep_settings_name_the_key(tmp_path: Path) -> None:
    r = prep(
        write_plan(tmp_path, [ds("ultrachat")], prep={"shard_rowz": 3}),
        "--dataset",
        "ultrachat",
        "--out",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "prep.shard_rowz: unknown key" in r.stderr
    r = prep(
        write_plan(
            tmp_path, [ds("ultrachat", source="ultrachat", kind="prompt-only")], prep={"reject_threshold": 2}
        ),
        "--dataset",
        "ultrachat",
        "--out",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "prep.reject_threshold: expected a fraction between 0 and 1" in r.stderr
    r = prep(write_plan(tmp_path, [ds("ultrachat")]), "--dataset", "nope", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no dataset named 'nope'" in r.stderr
