"""Reading the tokenized shards that prep / regen write, and the held-out split every EAGLE-3 stage shares.

Input contract (docs/data-formats.md; the manifest's definition: :mod:`pipeline.manifests.shards`): an upstream
out dir holds ``manifest.json`` with ``{"kind": "tokenized", "tokens": N, "shards": [{"file": ...}, ...]}`` (or
sub-folders that each hold one), and
Parquet shards with columns ``id``, ``input_ids`` (list<int32>), ``loss_mask`` (list<int8>, 1 on
assistant tokens) and ``num_tokens``. Manifests of other kinds (``prompts``) are skipped.

The held-out split is a pure function of the row id (a hash), so extraction, vocab, online training
and the acceptance benchmark agree on it without talking to each other: ``[bench] holdout`` is the
share of rows kept out of training (default 0.05), for the acceptance measurement.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.manifests import shards as shards_manifest
from pipeline.manifests.base import ManifestError, of_kind

TOKENIZED = shards_manifest.TOKENIZED
REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask")


class ShardError(ValueError):
    """Bad input data; the message names the file, the row and the field."""


@dataclass(frozen=True)
class Row:
    id: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    source: str  # "file:row" for error messages

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def prompt(self) -> np.ndarray:
        """The tokens before the first assistant token: what the acceptance benchmark generates from."""
        nz = np.flatnonzero(self.loss_mask)
        return self.input_ids[: int(nz[0])] if nz.size else self.input_ids


@dataclass(frozen=True)
class ShardRef:
    path: Path
    rows: int | None
    tokens: int | None


def holdout_fraction(plan: Any) -> float:
    """``[bench] holdout``: the share of every dataset's rows kept out of training."""
    return float(plan.settings.bench.holdout)


def is_heldout(row_id: str, fraction: float) -> bool:
    """Stable across processes and machines (not Python's salted ``hash``)."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha1(str(row_id).encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def tokenized_manifests(out_dir: Path) -> list[tuple[Path, shards_manifest.ShardsManifest]]:
    """Every ``tokenized`` manifest of an upstream out dir (top level, else one level of sub-folders), read
    through :mod:`pipeline.manifests.shards`; a damaged one is a :class:`ShardError` naming the file and key."""
    try:
        return [(p, shards_manifest.read(p)) for p in of_kind(Path(out_dir), (TOKENIZED,))]
    except ManifestError as exc:
        raise ShardError(str(exc)) from None


def tokenized_shards(out_dirs: list[Path]) -> list[ShardRef]:
    """The Parquet shards of every ``tokenized`` manifest under ``out_dirs``, in a stable order."""
    refs: list[ShardRef] = []
    for d in out_dirs:
        for mpath, man in tokenized_manifests(d):
            for i, s in enumerate(man.shards):
                p = mpath.parent / s.file
                if not p.is_file():
                    raise ShardError(f"{mpath}: shards[{i}].file {s.file!r} does not exist ({p})")
                refs.append(ShardRef(p, s.rows, s.token_count))
    return refs


def read_shard(path: Path, vocab_size: int | None = None, max_length: int | None = None) -> Iterator[Row]:
    """Rows of one shard, validated; truncated to ``max_length`` tokens when given."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types
        raise ShardError(f"{path}: cannot read as Parquet: {exc}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ShardError(
            f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(table.column_names)})"
        )
    ids = table.column("id").to_pylist()
    toks = table.column("input_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    for i, (rid, t, m) in enumerate(zip(ids, toks, masks, strict=True)):
        where = f"{path}: row {i} (id={rid!r})"
        if t is None or m is None:
            raise ShardError(f"{where}: input_ids/loss_mask is null")
        if len(t) != len(m):
            raise ShardError(f"{where}: loss_mask has {len(m)} values but input_ids has {len(t)}")
        ti = np.asarray(t, dtype=np.int64)
        mi = np.asarray(m, dtype=np.int64)
        if mi.size and (mi.min() < 0 or mi.max() > 1):
            raise ShardError(f"{where}: loss_mask must hold only 0 and 1")
        if ti.size and (ti.min() < 0 or (vocab_size is not None and ti.max() >= vocab_size)):
            raise ShardError(
                f"{where}: input_ids out of range 0..{(vocab_size or 0) - 1} (got {ti.min()}..{ti.max()})"
            )
        if max_length is not None:
            ti, mi = ti[:max_length], mi[:max_length]
        yield Row(str(rid), ti.astype(np.int32), mi.astype(np.int8), f"{path.name}:{i}")


def training_order(rows: list[Row]) -> list[Row]:
    """Longest first, then by id: the order extraction stores rows in, and online training indexes them."""
    return sorted(rows, key=lambda r: (-r.num_tokens, r.id))


def iter_rows(
    out_dirs: list[Path],
    holdout: float,
    split: str = "train",
    vocab_size: int | None = None,
    max_length: int | None = None,
) -> Iterator[Row]:
    """Rows of the ``train`` or ``heldout`` split over all tokenized inputs, in a stable order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_held = split == "heldout"
    for ref in tokenized_shards(out_dirs):
        for row in read_shard(ref.path, vocab_size, max_length):
            if is_heldout(row.id, holdout) == want_held:
                yield row
