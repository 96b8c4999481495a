"""The remote agent as a real process on pipes (what the SSH channel carries), without ssh."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.run.hosts.remote_agent import PROTOCOL, read_many

ROOT = Path(__file__).resolve().parent.parent


def converse(run: Path, *requests: object) -> tuple[list[dict], int]:
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests)
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.run.hosts.remote_agent", str(run)],
        input=lines.encode(),
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    return [json.loads(x) for x in p.stdout.splitlines()], p.returncode


def test_reads_from_offsets_and_refuses_paths_outside_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "stages" / "a").mkdir(parents=True)
    (run / "plan.toml").write_text("[run]\n")
    ev = run / "stages" / "a" / "events.jsonl"
    ev.write_bytes(b'{"type":"started","t":1}\n{"type":"finished","t":2,"status":"succeeded"}\n')
    (tmp_path / "secret").write_text("no")
    answers, rc = converse(
        run,
        {"id": 1, "op": "hello"},
        {"id": 2, "op": "read", "reqs": [["stages/a/events.jsonl", 25], ["stages/b/events.jsonl", 0]]},
        {"id": 3, "op": "read", "reqs": [["../secret", 0]]},
        "not json",
        {"id": 4, "op": "frobnicate"},
        {"id": 5, "op": "ctl", "args": ["pause", "nope"]},
    )
    assert rc == 0  # stdin closed: the agent exits cleanly
    by_id = {a["id"]: a for a in answers}
    assert by_id[1]["ok"] and by_id[1]["protocol"] == PROTOCOL and by_id[1]["exists"] is True
    (data, size, ino), (missing, msize, _) = by_id[2]["results"]
    assert (
        base64.b64decode(data) == ev.read_bytes()[25:]
        and size == ev.stat().st_size
        and ino == ev.stat().st_ino
    )
    assert missing == "" and msize == -1
    assert not by_id[3]["ok"] and "leaves the run directory" in by_id[3]["error"]
    assert not by_id[None]["ok"] and "bad request" in by_id[None]["error"]
    assert not by_id[4]["ok"] and "frobnicate" in by_id[4]["error"]
    # ctl runs pipeline.run.supervise.ctl on this host: an unknown stage is its usage error (exit 2), passed through
    assert by_id[5]["ok"] and by_id[5]["rc"] == 2 and "unknown stage 'nope'" in by_id[5]["stderr"]


def test_one_answer_is_bounded_and_the_reader_continues_from_its_offset(tmp_path: Path) -> None:
    big = tmp_path / "big.log"
    big.write_bytes(b"x" * 3000)
    small = tmp_path / "small.log"
    small.write_bytes(b"y" * 10)
    first = read_many(tmp_path, [["big.log", 0], ["small.log", 0]], max_bytes=1 << 20, budget=1000)
    assert len(base64.b64decode(first[0][0])) == 1000 and first[0][1] == 3000
    assert first[1][0] == "" and first[1][1] == 10  # over budget: nothing now, size still reported
    rest = read_many(tmp_path, [["big.log", 1000], ["small.log", 0]], max_bytes=1 << 20)
    assert base64.b64decode(rest[0][0]) == b"x" * 2000 and base64.b64decode(rest[1][0]) == b"y" * 10
