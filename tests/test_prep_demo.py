"""The demo plan's ten preps, run by the real supervisor from the shipped fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline.run.rundir.events import decode

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "pipeline" / "plans" / "demo.toml"


def toml_value(v: object) -> str:
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


@pytest.mark.slow
def test_the_demo_preps_all_ten_sources_under_the_supervisor(tmp_path: Path) -> None:
    demo = tomllib.loads(DEMO.read_text())
    lines = [
        "[run]",
        'name = "demo-prep"',
        "[executor]",
        'kind = "local"',
        "[resources]",
        f"cpu_slots = {demo['resources']['cpu_slots']}",
        "gpus = []",
        "[target]",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in demo["target"].items()]
    lines.append("[prep]")
    lines += [f"{k} = {toml_value(v)}" for k, v in demo["prep"].items()]
    for d in demo["datasets"]:
        lines.append("[[datasets]]")
        lines += [
            f"{k} = {toml_value(str((DEMO.parent / v).resolve()) if k == 'path' else v)}"
            for k, v in d.items()
        ]
    prep_stage = next(s for s in demo["stage"] if s["id"] == "prep")
    lines.append("[[stage]]")
    lines += [f"{k} = {toml_value(v)}" for k, v in prep_stage.items()]
    plan = tmp_path / "plan.toml"
    plan.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", "--create", str(plan), str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    state = json.loads((run / "state.json").read_text())
    preps = {s["id"]: s for s in state["stages"] if s["family"] == "prep"}
    assert len(preps) == 10
    assert {sid: s["state"] for sid, s in preps.items()} == {sid: "succeeded" for sid in preps}
    kinds = {d["name"]: d["kind"] for d in demo["datasets"]}
    for d in demo["datasets"]:
        stage = run / "stages" / f"prep.{d['name']}"
        man = json.loads((stage / "out" / "manifest.json").read_text())
        assert man["kind"] == ("tokenized" if kinds[d["name"]] == "target-native" else "prompts")
        assert man["rows"] == d["quota"] and man["rejects"] >= 2 and man["duplicates"] >= 1
        assert len((stage / "out" / "rejects.jsonl").read_text().splitlines()) == man["rejects"]
        evs = [decode(x) for x in (stage / "events.jsonl").read_text().splitlines()]
        last = [e for e in evs if e.type == "progress"][-1]
        assert (last.get("done"), last.get("total"), last.get("unit"), last.get("key")) == (
            d["quota"],
            d["quota"],
            "rows",
            d["name"],
        )
        assert "Traceback" not in (stage / "stage.log").read_text()
