"""Writing token and prompt shards: numbered Parquet files, atomic and resumable (the read side is
:mod:`pipeline.data.shards`).

Shards (:class:`ShardStore`)
    Numbered Parquet files ``data-00000.parquet`` written atomically (temp file, fsync, rename) with the
    ``datasets`` features of :func:`features` ``("tokenized")`` (id, input_ids list<int32>, loss_mask
    list<int8>, num_tokens int32) or ``("prompts")`` (id, messages list<{role, content}>). After each shard
    its record ``progress/data-00000.json`` (rows, tokens, sha256, the caller's resume state and the
    run's *fingerprint*) is written atomically; :meth:`ShardStore.finished` returns the verified prefix
    of finished shards, so a retry skips them. ``manifest.json`` is written last; its presence with the
    same fingerprint means the whole output is done. The on-disk format is described in
    docs/data-formats.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.tokenise import Encoded
from pipeline.manifests import shards as shards_manifest
from pipeline.manifests.shards import ShardEntry, ShardsManifest
from pipeline.run.rundir.files import publish, sha256_file
from pipeline.run.rundir.layout import read_json, write_atomic, write_json

FORMAT_VERSION = 1
SHARD_PREFIX = "data-"


class StaleOutputError(RuntimeError):
    """The output directory holds shards made with different settings."""


def features(kind: str) -> Any:
    """The ``datasets.Features`` of a shard kind: ``"tokenized"`` or ``"prompts"``."""
    from datasets import Features, List, Value

    if kind == "tokenized":
        return Features(
            {
                "id": Value("string"),
                "input_ids": List(Value("int32")),
                "loss_mask": List(Value("int8")),
                "num_tokens": Value("int32"),
            }
        )
    if kind == "prompts":
        return Features(
            {"id": Value("string"), "messages": List({"role": Value("string"), "content": Value("string")})}
        )
    raise ValueError(f"unknown shard kind {kind!r}")


def _list_array(arrays: Sequence[np.ndarray], dtype: Any) -> Any:
    import pyarrow as pa

    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values))


def tokenized_table(ids: Sequence[str], encoded: Sequence[Encoded]) -> Any:
    """A pyarrow table with the tokenized shard schema."""
    import pyarrow as pa

    schema = features("tokenized").arrow_schema
    return pa.table(
        {
            "id": pa.array(list(ids), type=pa.string()),
            "input_ids": _list_array([e.input_ids for e in encoded], np.int32),
            "loss_mask": _list_array([e.loss_mask for e in encoded], np.int8),
            "num_tokens": pa.array([e.num_tokens for e in encoded], type=pa.int32()),
        },
        schema=schema,
    )


def prompt_table(ids: Sequence[str], prompts: Sequence[list[dict[str, str]]]) -> Any:
    """A pyarrow table with the prompt shard schema."""
    import pyarrow as pa

    schema = features("prompts").arrow_schema
    return pa.table(
        {
            "id": pa.array(list(ids), type=pa.string()),
            "messages": pa.array(list(prompts), type=schema.field("messages").type),
        },
        schema=schema,
    )


def write_parquet_atomic(table: Any, path: Path) -> str:
    """Write ``table`` to ``path`` atomically; returns the file's sha256. Deterministic for equal tables."""
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=4096)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sha256_file(path)


class ShardStore:
    """Numbered shards + per-shard records + manifest in one output directory (see the module docstring)."""

    def __init__(self, out: Path, fingerprint: dict[str, Any]) -> None:
        self.out = Path(out)
        self.fingerprint = {"format_version": FORMAT_VERSION, **fingerprint}
        self.progress_dir = self.out / "progress"

    @property
    def manifest_path(self) -> Path:
        return self.out / "manifest.json"

    def shard_name(self, index: int) -> str:
        return f"{SHARD_PREFIX}{index:05d}.parquet"

    def record_path(self, index: int) -> Path:
        return self.progress_dir / f"{SHARD_PREFIX}{index:05d}.json"

    def clean_partials(self) -> list[Path]:
        """Remove temp files a killed writer left behind (only ``.*.partial`` in this store)."""
        gone = []
        for d in (self.out, self.progress_dir):
            if d.is_dir():
                for p in d.glob(".*.partial"):
                    p.unlink(missing_ok=True)
                    gone.append(p)
        return gone

    def _check_fingerprint(self, fp: dict[str, Any] | None, what: str) -> None:
        if fp != self.fingerprint:
            diff = sorted(
                k
                for k in set(fp or {}) | set(self.fingerprint)
                if (fp or {}).get(k) != self.fingerprint.get(k)
            )
            raise StaleOutputError(
                f"{what} was made with different settings ({', '.join(diff)} changed); "
                "retry the stage with --fresh to start over"
            )

    def finished(self) -> list[dict[str, Any]]:
        """Records of the finished shards 0..k-1 whose files are intact; stops at the first gap."""
        out = []
        index = 0
        while True:
            rec = read_json(self.record_path(index))
            if rec is None:
                break
            self._check_fingerprint(rec.get("fingerprint"), str(self.record_path(index)))
            path = self.out / rec["file"]
            if not path.is_file() or sha256_file(path) != rec["sha256"]:
                break
            out.append(rec)
            index += 1
        return out

    def commit(self, index: int, table: Any, state: dict[str, Any]) -> dict[str, Any]:
        """Write shard ``index`` and then its record (with the caller's resume ``state``)."""
        name = self.shard_name(index)
        sha = write_parquet_atomic(table, self.out / name)
        tokens = (
            int(table.column("num_tokens").to_numpy().sum()) if "num_tokens" in table.column_names else None
        )
        rec = {
            "index": index,
            "file": name,
            "rows": table.num_rows,
            "tokens": tokens,
            "sha256": sha,
            "fingerprint": self.fingerprint,
            **state,
        }
        write_json(self.record_path(index), rec)
        return rec

    def manifest(self) -> ShardsManifest | None:
        """The manifest (:mod:`pipeline.manifests.shards`), or None before the output is finished."""
        if not self.manifest_path.is_file():
            return None
        return shards_manifest.read(self.manifest_path)

    def complete(self) -> ShardsManifest | None:
        """The manifest when the output is finished with these settings and every shard is intact."""
        man = self.manifest()
        if man is None:
            return None
        self._check_fingerprint(man.fingerprint, str(self.manifest_path))
        for s in man.shards:
            p = self.out / s.file
            if not p.is_file() or sha256_file(p) != s.sha256:
                return None
        return man

    def write_manifest(self, kind: str, records: Iterable[dict[str, Any]], **fields: Any) -> ShardsManifest:
        """``manifest.json`` over the shard ``records`` (:meth:`commit`'s); ``fields`` are the manifest's
        other keys, each a field of :class:`~pipeline.manifests.shards.ShardsManifest`."""
        shards = tuple(
            ShardEntry(file=r["file"], rows=r["rows"], sha256=r["sha256"], tokens=r.get("tokens"))
            for r in records
        )
        man = ShardsManifest(
            kind=kind,
            shards=shards,
            rows=sum(s.rows or 0 for s in shards),
            fingerprint=self.fingerprint,
            tokens=sum(s.tokens or 0 for s in shards) if kind == shards_manifest.TOKENIZED else None,
            **fields,
        )
        shards_manifest.write(self.manifest_path, man)
        return man


def write_rejects(path: Path, rejects: Iterable[dict[str, Any]]) -> None:
    """``rejects.jsonl``: one ``{row, field, reason}`` object per line, written atomically."""
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rejects))
