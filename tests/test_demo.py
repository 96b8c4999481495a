"""The README's first command, headless: the whole demo pipeline runs to success on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, at_normal_priority


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the demo takes ~9 of its 10 minutes on 2 cores: the suite's 600 s is too close
def test_demo_headless_runs_every_stage_to_success(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMP_NUM_THREADS", None)  # the suite's one thread per worker: the demo runs as a user runs it
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "demo", "--headless", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
        cwd=tmp_path,
        preexec_fn=at_normal_priority,  # the suite's long pole: first call on the cores (tests/conftest.py)
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "run succeeded" in out.stdout
    state = json.loads((run_dir / "state.json").read_text())
    states = {s["id"]: s["state"] for s in state["stages"]}
    assert states and set(states.values()) == {"succeeded"}, states
    # The ten sources were each prepped from their bundled fixture.
    preps = [s for s in states if s.startswith("prep.")]
    assert len(preps) == 10
    for sid in preps:
        manifest = json.loads((run_dir / "stages" / sid / "out" / "manifest.json").read_text())
        assert manifest["rows"] > 0
    # The draft works: the bench's accept length at steps = 3 on held-out prompts of every dataset. Measured
    # 1.62 on the 2-core dev VM (docs/eagle3.md, "The demo"; issue 15 asks >= 1.5); an untrained-looking draft
    # measured 1.19. The bar is 1.4, not 1.5: regen's greedy answers come from a continuously batching CPU
    # server whose batch composition depends on timing, so a few answers can differ by a token between
    # machines and the 9-prompt mean moves with them.
    bench = json.loads((run_dir / "stages" / "bench" / "out" / "results.json").read_text())
    assert bench["accept_len"] >= 1.4, bench["per_prompt"]
    assert len({p["id"].rsplit("-", 1)[0] for p in bench["per_prompt"]}) >= 5  # the mix, not one dataset
    assert f"bench: mean accepted length {bench['accept_len']:.3f}" in out.stdout
    status = subprocess.run(
        [sys.executable, "-m", "console.cli", "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert status.returncode == 0
    # a line per stage, the run (projection, supervisor), the anomalies going on, the audit log
    lines = [json.loads(ln) for ln in status.stdout.splitlines()]
    rows = [ln for ln in lines if "id" in ln]
    assert len(rows) == len(states)
    projection = next(ln for ln in lines if "projection" in ln)["projection"]
    # The demo's only alert, when it comes, is the train-versus-measured gap (issue 44 item 10): its draft's
    # simulated accept length (the best of its evaluations, teacher-forced on held-out rows) is above what the
    # bench measures decoding freely — 2.13 vs 1.67 on the dev VM, 21 %. The alert carries both numbers.
    anomalies = next(ln for ln in lines if "anomalies" in ln)["anomalies"]
    assert {a["kind"] for a in anomalies} <= {"accept-gap"}, anomalies
    trained = json.loads((run_dir / "stages" / "train" / "out" / "manifest.json").read_text())
    for a in anomalies:
        assert f"measured {bench['accept_len']:.4g}" in a["evidence"][0]
        assert f"simulated {trained['accept_length']:.4g}" in a["evidence"][1]
    assert lines[-1]["audit"]["total"] == 0  # nobody paused, killed or retried anything
    assert projection["finished"] and projection["will_finish"] and projection["progress"] == 1.0
