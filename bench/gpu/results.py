"""The results files the GPU experiments write under ``$OUT`` (what comes back from the lent machine).

``write_out`` writes one experiment's JSON document. The SGLang serving bench keeps its figures in ``RESULTS``
(one dict per process, shared by its phases and the server wrapper) and ``save_results`` merges them into
``/tmp/sgl/results.json``, so back-to-back calls on a warm machine add up, and copies the whole to
``$OUT/gpu_sglang.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bench.gpu.runner import BASE, OUT
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.protocol import Message, Metric, RunEvent, decode_all

RESULTS: dict[str, Any] = {"bench": "gpu_sglang"}
MERGED = BASE / "results.json"


def write_out(name: str, doc: dict[str, Any]) -> None:
    """``$OUT/NAME`` as indented JSON; nothing when ``$OUT`` is unset (a local run)."""
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(json.dumps(doc, indent=1))


def save_results() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    doc = json.loads(MERGED.read_text()) if MERGED.exists() else {}
    doc.update(RESULTS)
    MERGED.write_text(json.dumps(doc, indent=1))
    (OUT / "gpu_sglang.json").write_text(json.dumps(doc, indent=1))


def stage_events(out: Path) -> list[RunEvent]:
    """The events of a stage's out dir (``events.jsonl``, every generation), typed (``pipeline.run.rundir.protocol``)."""
    return decode_all(read_all(out / "events.jsonl"))


def stage_metrics(out: Path, name: str | None = None) -> list[Metric]:
    """A stage's metric events, in order: all of them, or one name's."""
    return [e for e in stage_events(out) if isinstance(e, Metric) and (name is None or e.name == name)]


def stage_messages(out: Path) -> list[Message]:
    return [e for e in stage_events(out) if isinstance(e, Message)]
