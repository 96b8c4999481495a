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
