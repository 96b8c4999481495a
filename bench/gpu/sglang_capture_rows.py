"""The SGLang capture bench's rows and result file: two-turn chats cut from this repository's docs, written as a
``tokenized`` shard through SmolLM2's chat template, and ``$OUT/gpu_sglang_capture.json`` (``RESULTS``, saved
after every step). Shared by the offline comparison (``sglang_capture``) and the online phase
(``sglang_capture_online``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.gpu.runner import OUT, ROOT

RESULTS: dict[str, Any] = {"bench": "gpu_sglang_capture"}


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_sglang_capture.json").write_text(json.dumps(RESULTS, indent=1))


def chats(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (question, answer) pairs cut from the repo's docs: consecutive paragraphs, real English."""
    import random

    paras: list[str] = []
    for f in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for p in re.split(r"\n\s*\n", f.read_text()):
            p = " ".join(p.split())
            if 80 <= len(p) <= 1500 and not p.startswith(("|", "```")):
                paras.append(p)
    rnd = random.Random(seed)
    pairs = [(paras[i][:400], paras[i + 1]) for i in range(len(paras) - 1)]
    rnd.shuffle(pairs)
    return pairs[:n]


def write_rows(tok_dir: Path, out: Path, n: int, max_length: int) -> int:
    """A ``tokenized`` shard of ``n`` chats through SmolLM2's chat template; returns the token count."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    if (out / "manifest.json").exists():  # a warm machine's earlier call: reused only for the same request
        old = json.loads((out / "manifest.json").read_text())
        if old.get("asked") == {"rows": n, "max_length": max_length}:
            return int(old["tokens"])
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids, masks, names = [], [], []
    for i, (q, a) in enumerate(chats(n)):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        full = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        prompt, full = list(_ids(prompt)), list(_ids(full))[:max_length]
        if len(full) <= len(prompt) + 1:
            continue
        ids.append(full)
        masks.append([0] * len(prompt) + [1] * (len(full) - len(prompt)))
        names.append(f"docs-{i}")
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": names,
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
            "num_tokens": [len(x) for x in ids],
        }
    )
    pq.write_table(table, out / "rows-00000.parquet")
    total = sum(len(x) for x in ids)
    manifest = {
        "kind": "tokenized",
        "shards": [{"file": "rows-00000.parquet", "rows": len(ids), "tokens": total}],
    }
    asked = {"rows": n, "max_length": max_length}
    (out / "manifest.json").write_text(json.dumps({**manifest, "tokens": total, "asked": asked}))
    return total


def _ids(x: Any) -> list[int]:
    """``apply_chat_template`` returns a list, or a BatchEncoding on newer transformers."""
    return list(x["input_ids"] if hasattr(x, "keys") else x)
