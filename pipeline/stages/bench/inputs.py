"""What a bench stage reads from its inputs: the trained draft's manifest and the held-out prompts."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.shards import find_manifests, iter_rows


def find_draft(inputs: list[Path]) -> tuple[dict, Path]:
    for d in inputs:
        for mpath, man in find_manifests(d):
            if man.get("kind") == "draft":
                return man, mpath.parent
    raise ValueError(
        f"no trained draft among the inputs ({', '.join(map(str, inputs)) or 'none'}): "
        "put the train stage in 'after'"
    )


def heldout_prompts(man: dict, n: int, vocab_size: int) -> list[tuple[str, list[int]]]:
    """Up to ``n`` held-out (id, prompt ids), taken in turn from each token source (one per dataset):
    the acceptance of the training mix, not of whichever dataset happens to come first."""
    sources = [Path(p) for p in man.get("token_sources", [])]
    holdout = float(man.get("holdout") or 0.0)
    streams = [iter_rows([src], holdout, "heldout", vocab_size, man.get("max_length")) for src in sources]
    out: list[tuple[str, list[int]]] = []
    while streams and len(out) < n:
        for it in list(streams):
            found = next(((r.id, p) for r in it if 0 < (p := r.prompt()).size < r.num_tokens), None)
            if found is None:
                streams.remove(it)
                continue
            out.append((found[0], found[1].astype("int64").tolist()))
            if len(out) >= n:
                break
    return out
