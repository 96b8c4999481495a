"""Kill a real prep process mid-run, retry, and get byte-identical shards to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.run.rundir.files import sha256_file

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def make_source(path: Path, n: int) -> None:
    """``n`` agent trajectories in the DeepSWE (OpenAI tool-call) schema, every 37th one malformed, some repeated."""
    with path.open("w") as fh:
        for i in range(n):
            k = i - 45 if i % 50 == 7 and i > 45 else i  # an exact repeat of a row about a shard earlier
            msgs = [
                {
                    "role": "user",
                    "content": f"Fix issue #{k}: the parser drops field {k % 13} when value is {k * 7}.",
                },
                {
                    "role": "assistant",
                    "content": f"Looking at parser.py for field {k % 13}.",
                    "tool_calls": [
                        {
                            "id": f"c{k}",
                            "type": "function",
                            "function": {
                                "name": "execute_bash",
                                "arguments": json.dumps({"command": f"grep -n f{k} parser.py"}),
                            },
                        }
                    ],
                },
                {"role": "tool", "content": f"{k % 97}: def parse_{k}(value):", "tool_call_id": f"c{k}"},
                {
                    "role": "assistant",
                    "content": f"Fixed: parse_{k} now keeps field {k % 13}. " + "Tests pass. " * (k % 9),
                },
            ]
            if i % 37 == 20:
                msgs[1]["role"] = "bot"
            fh.write(json.dumps({"instance_id": f"repo__{k}", "messages": msgs}) + "\n")


def write_plan(tmp: Path, source: Path, quota: int) -> Path:
    plan = tmp / "plan.toml"
    plan.write_text(f"""
[run]
name = "resume"
dir = "{tmp / "run"}"
[target]
model = "builtin:smollm2-135m-instruct"
max_length = 256
[prep]
shard_rows = 40
batch_rows = 10
check_rows = 20
reject_threshold = 0.1
[[datasets]]
name = "big"
source = "deepswe-kimi-k2"
kind = "target-native"
quota = {quota}
path = "{source}"
[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"
""")
    return plan


def env_for(plan: Path, out: Path, run: Path | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    if run is not None:  # as the launcher would run it: pause requests are honoured
        e.update(AERIE_RUN_DIR=str(run), AERIE_STAGE_ID="prep.big", AERIE_OUT=str(out), AERIE_PLAN=str(plan))
    return e


def start(plan: Path, out: Path, run: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "pipeline.stages.prep", "--plan", str(plan), "--dataset", "big"]
    if run is None:
        args += ["--out", str(out)]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env_for(plan, out, run),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"prep ended before the kill: {proc.stderr.read()}"
        assert time.monotonic() - t0 < timeout, "timed out waiting for the prep stage"
        time.sleep(0.01)


def outputs(out: Path) -> dict[str, str]:
    files = sorted(out.glob("data-*.parquet")) + [out / "rejects.jsonl"]
    return {p.name: sha256_file(p) for p in files}


def manifest_without_fp(out: Path) -> dict:
    man = json.loads((out / "manifest.json").read_text())
    man.pop("fingerprint")
    return man


def test_kill_mid_run_then_retry_gives_byte_identical_shards(tmp_path: Path) -> None:
    source = tmp_path / "big.jsonl"
    make_source(source, 1400)
    plan = write_plan(tmp_path, source, quota=1200)

    ref = tmp_path / "ref"
    p = start(plan, ref)
    assert p.wait(timeout=600) == 0, p.stderr.read()
    ref_files = outputs(ref)
    assert len(ref_files) == 31  # 30 shards of 40 rows + rejects.jsonl

    # 1) killed at an arbitrary moment, while it is tokenising and writing
    out, run = tmp_path / "out", tmp_path / "run"
    p = start(plan, out)
    wait_for(lambda: (out / "progress" / "data-00002.json").exists(), p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "manifest.json").exists()

    # 2) retried under a run dir, paused at a safe point after a few more shards, then killed there
    p = start(plan, out, run)
    pause = run / "stages" / "prep.big" / "pause"
    wait_for(lambda: (out / "progress" / "data-00008.json").exists(), p)
    pause.touch()
    ev = run / "stages" / "prep.big" / "events.jsonl"
    wait_for(lambda: '"code":"paused"' in ev.read_text(), p)
    resumed = [json.loads(x) for x in ev.read_text().splitlines() if '"code":"resume"' in x]
    assert resumed and "resuming after" in resumed[0]["text"]
    p.send_signal(signal.SIGKILL)
    p.wait()
    pause.unlink()
    done = len(list((out / "progress").glob("data-*.json")))
    assert 9 <= done < 30 and not (out / "manifest.json").exists()

    # 3) the final retry finishes the rest
    p = start(plan, out)
    assert p.wait(timeout=600) == 0, p.stderr.read()
    assert outputs(out) == ref_files
    assert manifest_without_fp(out) == manifest_without_fp(ref)
    assert not list(out.glob(".*.partial")) and not list((out / "progress").glob(".*.partial"))
