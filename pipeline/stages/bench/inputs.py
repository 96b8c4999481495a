"""What a bench stage reads from its inputs: the trained draft's manifest and the held-out prompts."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.shards import iter_rows
from pipeline.manifests import train as train_manifest
from pipeline.manifests.base import of_kind
from pipeline.manifests.train import DraftManifest


def find_draft(inputs: list[Path]) -> tuple[DraftManifest, Path]:
    """The train stage's ``draft`` manifest among the inputs (:mod:`pipeline.manifests.train`), and its folder."""
    for d in inputs:
        for mpath in of_kind(d, (train_manifest.KIND,)):
            return train_manifest.read(mpath), mpath.parent
    raise ValueError(
        f"no trained draft among the inputs ({', '.join(map(str, inputs)) or 'none'}): "
        "put the train stage in 'after'"
    )


def heldout_prompts(man: DraftManifest, n: int, vocab_size: int) -> list[tuple[str, list[int]]]:
    """Up to ``n`` held-out (id, prompt ids), taken in turn from each token source (one per dataset):
    the acceptance of the training mix, not of whichever dataset happens to come first."""
    holdout = man.holdout or 0.0
    streams = [iter_rows([src], holdout, "heldout", vocab_size, man.max_length) for src in man.source_dirs]
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
