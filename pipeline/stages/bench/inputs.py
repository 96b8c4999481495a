"""What a bench stage reads from its inputs: the trained draft's manifest and the held-out prompts."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.shards import find_manifests, iter_rows


def find_draft(inputs: list[Path]) -> tuple[dict, Path]:
    for d in inputs:
        for mpath, man in find_manifests(d):
            if man.get("kind") == "draft":
                return man, mpath.parent
    raise ValueError(f"no trained draft among the inputs ({', '.join(map(str, inputs)) or 'none'}): "
                     "put the train stage in 'after'")


def heldout_prompts(man: dict, n: int, vocab_size: int) -> list[tuple[str, list[int]]]:
    sources = [Path(p) for p in man.get("token_sources", [])]
    holdout = float(man.get("holdout") or 0.0)
    out = []
    for row in iter_rows(sources, holdout, "heldout", vocab_size, man.get("max_length")):
        p = row.prompt()
        if 0 < p.size < row.num_tokens:
            out.append((row.id, p.astype("int64").tolist()))
        if len(out) >= n:
            break
    return out
