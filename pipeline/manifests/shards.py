"""The ``tokenized`` and ``prompts`` manifests: what prep and regen write over their Parquet shards
(docs/data-formats.md, "Prep outputs" and "Regeneration outputs"), and what extract, vocab, regen and the disk
budget read.

Required: ``kind``, ``shards`` (each with its ``file``, relative to the manifest's folder) and, for
``tokenized``, ``tokens``: the input contract any writer of a tokenized dataset meets (a hand-made one too).
Everything else the stages write is typed here and optional; keys this class does not name stay in
``extra`` and are written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.manifests.base import EXTRA, OMIT, ManifestError, decode, encode, reader, write_doc

VERSION = 1
TOKENIZED = "tokenized"
PROMPTS = "prompts"
KINDS = (TOKENIZED, PROMPTS)


@dataclass(frozen=True)
class ShardEntry:
    """One shard of the manifest: its file, rows, sha256 of the whole file and (tokenized) tokens."""

    file: str
    rows: int | None = field(default=None, metadata=OMIT)
    sha256: str | None = field(default=None, metadata=OMIT)
    tokens: int | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)

    @property
    def token_count(self) -> int | None:
        """``tokens``, or ``num_tokens`` as some hand-made manifests name it."""
        if self.tokens is not None:
            return self.tokens
        legacy = self.extra.get("num_tokens")
        return legacy if isinstance(legacy, int) and not isinstance(legacy, bool) else None


@dataclass(frozen=True)
class ShardsManifest:
    """A ``tokenized`` or ``prompts`` output: its shards and the counts and settings they were made with."""

    VERSION = VERSION

    kind: str
    shards: tuple[ShardEntry, ...]
    tokens: int | None = field(default=None, metadata=OMIT)  # tokenized: required, the sum over the shards
    rows: int | None = field(default=None, metadata=OMIT)
    fingerprint: dict[str, Any] | None = field(default=None, metadata=OMIT)  # what the shards depend on
    dataset: str | None = field(default=None, metadata=OMIT)
    source: str | None = field(default=None, metadata=OMIT)
    quota: int | None = field(default=None, metadata=OMIT)
    rows_read: int | None = field(default=None, metadata=OMIT)
    rejects: int | None = field(default=None, metadata=OMIT)
    duplicates: int | None = field(default=None, metadata=OMIT)
    dropped: int | None = field(default=None, metadata=OMIT)
    tokenizer: str | None = field(default=None, metadata=OMIT)
    template_hash: str | None = field(default=None, metadata=OMIT)
    max_length: int | None = field(default=None, metadata=OMIT)
    # regen's own
    prompts: int | None = field(default=None, metadata=OMIT)
    answers: int | None = field(default=None, metadata=OMIT)
    skipped: int | None = field(default=None, metadata=OMIT)
    failed: int | None = field(default=None, metadata=OMIT)
    truncated_answers: int | None = field(default=None, metadata=OMIT)
    regenerated_by: dict[str, Any] | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)

    def _check(self, file: Path | str, prefix: str) -> None:
        if self.kind == TOKENIZED and self.tokens is None:
            raise ManifestError(file, prefix + "tokens", "missing (required in a tokenized manifest)")
        for key in ("tokens", "rows"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ManifestError(file, prefix + key, f"must be a non-negative integer, got {v}")

    @property
    def is_tokenized(self) -> bool:
        return self.kind == TOKENIZED

    @classmethod
    def from_dict(cls, doc: dict[str, Any], file: Path | str = "manifest") -> ShardsManifest:
        return decode(cls, doc, file, KINDS)

    def to_dict(self) -> dict[str, Any]:
        return encode(self)


read = reader(ShardsManifest, KINDS)


def write(path: Path, manifest: ShardsManifest) -> None:
    write_doc(path, manifest.to_dict())
