"""Every executor checks the engine first: ``aerie preflight`` of a local plan checks SGLang on this machine (as the
SSH preflight does on its host), and the stages that run SGLang refuse in seconds with the table's line.

"A host without SGLang" is real here: this interpreter started with ``-S`` (no site-packages at all; the
pipeline modules these checks import are standard library only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import tested_versions as tv
from pipeline.run.plan import dag as plan_mod

ROOT = Path(__file__).resolve().parent.parent

SERVE_PLAN = """[run]
name = "p"
dir = "run"
[target]
model = "{model}"
engine = "{engine}"
[serve]
backend = "{backend}"
[[stage]]
id = "serve"
run = "serve"
service = true
"""


def write(tmp_path: Path, engine: str = "transformers", backend: str = "sglang") -> Path:
    p = tmp_path / "plan.toml"
    p.write_text(SERVE_PLAN.format(model=tmp_path / "no-model", engine=engine, backend=backend))
    return p


def bare_python(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """This interpreter without site-packages (so without SGLang), Aerie's checkout on its path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-S", *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )


def test_local_preflight_refuses_a_sglang_plan_on_a_host_without_sglang(tmp_path: Path) -> None:
    r = bare_python("-m", "pipeline.serving.local_preflight", str(write(tmp_path)))
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "FAIL sglang" in r.stdout
        and "runs SGLang (serve)" in r.stdout
        and "SGLang is not installed" in r.stdout
    )
    if sys.version_info[:2] != (3, 12):  # the GPU lock cannot install here either: said in one line
        assert "FAIL python" in r.stdout and "CPython 3.12 only" in r.stdout
    assert "not ready" in r.stdout
    plain = write(tmp_path, backend="local")
    r = bare_python("-m", "pipeline.serving.local_preflight", str(plain))
    assert r.returncode == 0 and "runs no SGLang stage" in r.stdout, r.stdout + r.stderr


def test_aerie_preflight_of_a_local_plan_checks_sglang_with_the_stages_interpreter(tmp_path: Path) -> None:
    """Not "nothing to preflight": the line the table gives for what is installed in this interpreter."""
    path = write(tmp_path, engine="sglang")
    expected = tv.plan_sglang(plan_mod.load(path))
    assert expected is not None
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "preflight", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert "nothing to preflight" not in out
    assert r.returncode == (0 if expected.ok and expected.level != "absent" else 2), out
    assert "sglang" in out and expected.detail.split(":")[0] in out


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]


def test_the_serve_stage_refuses_in_seconds_without_sglang(tmp_path: Path) -> None:
    out = tmp_path / "out"
    t = time.monotonic()
    r = bare_python("-m", "pipeline.stages.serve", "--plan", str(write(tmp_path)), "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert time.monotonic() - t < 60  # generous: it stops before any server starts
    assert 'serve.backend = "sglang": SGLang is not installed here' in r.stderr
    errors = [e["text"] for e in _events(out) if e.get("type") == "message" and e.get("level") == "error"]
    assert errors and "SGLang is not installed" in errors[-1]


def test_the_extract_stage_refuses_an_untested_sglang_before_loading_the_target(tmp_path: Path) -> None:
    path = write(tmp_path, engine="sglang")
    line = tv.stage_refusal(plan_mod.load(path), "capture")
    if line is None:
        pytest.skip("a tested SGLang is installed here: the stage would go on to load the target")
    out = tmp_path / "ext"
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.stages.extract", "--plan", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert time.monotonic() - t < 120
    assert f'target.engine = "sglang": {line}' in r.stderr
    assert "no-model" not in r.stderr  # refused before the (missing) target was looked for
