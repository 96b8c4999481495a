"""A full disk (issue 18, item 2): the run directory on a small tmpfs of its own, filled during prep.

The test mounts a size-limited tmpfs (needs root: ``mount -t tmpfs -o size=...``), creates the run on it
and leaves only about a megabyte free with a ballast file, so the real ``prep`` stage, run by the real
supervisor, fills the disk part-way through its shards. Then:

* the stage fails with a message that names the device and "no space left" (``exit.json`` and the
  stage's own ``error`` event);
* every shard it recorded as finished is intact (its sha256 and row count match), nothing half-written
  is taken for done (no manifest, no shard counted without its record, no temp file left);
* the supervisor stays up through it, and its own files (``state.json``, every ``*.json``, every line
  of every ``events.jsonl``) still parse — nothing truncated;
* after the ballast is deleted, ``retry`` resumes from the finished shards (they are not rewritten)
  and completes with exactly the rows expected, each once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.run.rundir.files import sha256_file
from pipeline.run.rundir.layout import read_json
from tests.runs import ctl, kill_run_stages, make_run, start_supervisor, states, stop, wait_done, wait_for

ROWS = 1500


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a size-limited tmpfs (mount -t tmpfs -o size=...)")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m,mode=0755", "aerie-test-disk", str(disk)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def write_rows(path: Path) -> list[str]:
    rng = random.Random(18)
    ids = []
    with path.open("w") as fh:
        for i in range(ROWS):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(1200))
            ids.append(f"r{i:05d}")
            fh.write(
                json.dumps(
                    {
                        "id": ids[-1],
                        "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}],
                    }
                )
                + "\n"
            )
    return ids


def check_every_json_parses(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file() and p.suffix == ".json":
            json.loads(p.read_text())  # raises on a truncated file
        elif p.is_file() and p.name == "events.jsonl":
            data = p.read_text()
            assert data == "" or data.endswith("\n"), f"{p}: a torn last line"
            for line in data.splitlines():
                json.loads(line)


def shard_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "progress").glob("data-*.json"))]


def test_prep_on_a_full_disk_fails_naming_it_keeps_finished_shards_and_completes_after_space_is_freed(
    tmp_path: Path, small_disk: Path
) -> None:
    data = tmp_path / "chat.jsonl"
    expected_ids = write_rows(data)
    run = make_run(
        small_disk,
        f"""
[run]
name = "diskfull"
dir = "run"
[prep]
shard_rows = 100
batch_rows = 50
[[datasets]]
name = "chat"
source = "sharegpt"
kind = "prompt-only"
quota = {ROWS}
path = "{data}"
[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"
""",
    )
    # Leave ~1.2 MiB: the ~15 shards of ~100 KiB need more than that.
    st = os.statvfs(small_disk)
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - (1200 << 10)))
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 300) == {"prep.chat": "failed"}
        # alive, or gone because every stage is finished (exit 0): never a crash
        assert sup.poll() in (None, 0), "the supervisor died of the full disk"
        sd = run.stage("prep.chat")
        ex = read_json(sd.exit)
        assert ex["returncode"] != 0 and "no space left on device aerie-test-disk" in ex["detail"], ex
        assert f"tmpfs at {small_disk}" in ex["detail"], ex
        errors = [json.loads(line) for line in sd.events.read_text().splitlines()]
        nospace = [e for e in errors if e.get("code") == "nospace"]
        assert nospace and "aerie-test-disk" in nospace[0]["text"], (
            f"the stage did not say which disk filled: {sd.log.read_text()[-3000:]}"
        )
        # what is recorded as done is intact; nothing else counts
        out = sd.out
        recs = shard_records(out)
        assert recs, "the disk filled before the first shard: the test did not exercise a part-done stage"
        assert [r["index"] for r in recs] == list(range(len(recs)))
        for r in recs:
            assert sha256_file(out / r["file"]) == r["sha256"]
            assert pq.read_metadata(out / r["file"]).num_rows == r["rows"] == 100
        assert not (out / "manifest.json").exists()
        assert not list(out.rglob(".*.partial")), "a half-written temp file was left behind"
        assert len(recs) * 100 < ROWS
        check_every_json_parses(run.root)
        assert states(run) == {"prep.chat": "failed"}
        done_before = {r["file"]: r["sha256"] for r in recs}
        print(f"\ndisk full after {len(recs)} of {ROWS // 100} shards: {ex['detail']}")
        mtimes = {f: (out / f).stat().st_mtime_ns for f in done_before}

        ballast.unlink()  # space is freed
        r = ctl(run, "retry", "prep.chat")
        assert r.returncode == 0, r.stderr
        wait_for(lambda: states(run).get("prep.chat") != "failed", 30, "the retry to start")
        assert wait_done(run, 300) == {"prep.chat": "succeeded"}
    finally:
        stop(sup)
        kill_run_stages(run)
    man = json.loads((out / "manifest.json").read_text())
    assert man["rows"] == ROWS == sum(s["rows"] for s in man["shards"])
    ids = [
        row
        for s in man["shards"]
        for row in pq.read_table(out / s["file"], columns=["id"]).column("id").to_pylist()
    ]
    assert len(ids) == len(set(ids)) == ROWS
    assert sorted(ids) == sorted(f"chat-{i}" for i in range(ROWS)) or sorted(ids) == sorted(expected_ids)
    for f, sha in done_before.items():  # resumed: the finished shards were kept, not rewritten
        assert sha256_file(out / f) == sha and (out / f).stat().st_mtime_ns == mtimes[f]
    check_every_json_parses(run.root)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with a ballast file; returns it."""
    ballast = disk / "ballast-full"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 64 << 10, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return ballast


def test_an_event_line_is_written_whole_or_not_at_all_on_a_full_disk(small_disk: Path) -> None:
    from pipeline.run.rundir.events import EventWriter

    path = small_disk / "events.jsonl"
    failures = 0
    with EventWriter(path) as w:
        w.emit("message", text="0 " + "x" * 1500)  # the file's first page is now partly used
        fill(small_disk)  # no free page left: a line that crosses into a new page is written only in part
        for i in range(1, 10):
            size_before = path.stat().st_size
            try:
                w.emit("message", text=f"{i} " + "x" * 1500)
            except OSError as exc:
                assert exc.errno == 28
                assert path.stat().st_size == size_before, "a partly written line was left in the file"
                failures += 1
    assert failures, "the disk never filled"
    data = path.read_text()
    assert data == "" or data.endswith("\n")
    for line in data.splitlines():
        json.loads(line)


def test_the_supervisor_survives_a_completely_full_disk_and_carries_on_when_space_is_freed(
    small_disk: Path,
) -> None:
    run = make_run(
        small_disk,
        """
[run]
name = "full"
dir = "run"
[[stage]]
id = "a"
command = "echo a > out.txt"
[[stage]]
id = "b"
command = "echo b > out.txt"
after = ["a"]
""",
    )
    ballast = fill(small_disk)
    sup = start_supervisor(run)
    try:
        import time

        time.sleep(3)
        assert sup.poll() is None, "the supervisor died of the full disk"
        check_every_json_parses(run.root)
        assert (
            "cannot write the run directory: no space left on device aerie-test-disk"
            in (run.root / "supervisor.log").read_text()
            or run.supervisor_log.stat().st_size == 0
        )
        ballast.unlink()
        assert wait_done(run, 60) == {"a": "succeeded", "b": "succeeded"}
    finally:
        stop(sup)
        kill_run_stages(run)
    check_every_json_parses(run.root)


@pytest.fixture()
def disk_24m(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a size-limited tmpfs (mount -t tmpfs -o size=...)")
    disk = tmp_path / "disk24"
    disk.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0755", "aerie-test-disk", str(disk)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_extraction_on_a_full_disk_fails_naming_it_and_resumes_after_space_is_freed(
    tmp_path_factory, tmp_path: Path, disk_24m: Path
) -> None:
    from safetensors import safe_open

    from pipeline.data.shards import iter_rows
    from tests.eagle3_fixtures import events as stage_events
    from tests.eagle3_fixtures import run_stage, shared
    from tests.eagle3_fixtures import write_plan as write_eagle_plan

    tok = shared(tmp_path_factory, "tok")
    plan = write_eagle_plan(
        tmp_path / "plan.toml", extract={"shard_tokens": 250, "batch_tokens": 300}, bench={"holdout": 0.2}
    )
    out = disk_24m / "ext"
    st = os.statvfs(disk_24m)
    ballast = disk_24m / "ballast"
    # Leave room for ~3 of the ~10 shards (250 tokens of the tiny target: ~0.2 MB each), so the disk fills mid-way.
    ballast.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - (640 << 10)))
    p = run_stage("pipeline.stages.extract", plan, out, [tok], check=False)
    assert p.returncode != 0, "extraction did not run out of space"
    text = [e.get("text") for e in stage_events(out) if e.type == "message" and e.get("code") == "nospace"]
    assert text and text[0].startswith(f"no space left on device aerie-test-disk (tmpfs at {disk_24m}"), (
        text,
        p.stderr[-2000:],
    )
    state = json.loads((out / "extract-state.json").read_text())
    done = state["done"]
    assert done, "the disk filled before the first shard"
    assert not (out / "manifest.json").exists()
    for name, rec in done.items():  # every shard recorded as done is whole
        assert (out / name).stat().st_size == rec["bytes"]
        with safe_open(str(out / name), framework="pt") as f:
            assert f.get_tensor("offsets").numel() - 1 == rec["rows"]
    check_every_json_parses(out)
    stamps = {name: (out / name).stat().st_mtime_ns for name in done}
    print(f"\nextraction: disk full after {len(done)} shards: {text[0]}")
    ballast.unlink()
    run_stage("pipeline.stages.extract", plan, out, [tok])
    for name, ns in stamps.items():
        assert (out / name).stat().st_mtime_ns == ns, f"{name} was extracted twice"
    man = json.loads((out / "manifest.json").read_text())
    expected = [r for r in iter_rows([tok], 0.2, "train") if r.num_tokens >= 2 and r.loss_mask.any()]
    assert man["rows"] == len(expected) == sum(s["rows"] for s in man["shards"])
    check_every_json_parses(out)
