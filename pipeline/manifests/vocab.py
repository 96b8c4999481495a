"""The ``vocab`` manifest: what the vocab stage writes next to ``vocab.safetensors`` (the d2t / t2d maps:
``pipeline.eagle3.draft_vocab``), and what training reads to find them.

Required: ``kind``, ``draft_vocab_size`` and ``target_vocab_size``; ``file`` (default ``vocab.safetensors``)
names the tensors. Unknown keys stay in ``extra`` and are written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.manifests.base import EXTRA, OMIT, decode, encode, reader, write_doc

VERSION = 1
KIND = "vocab"
VOCAB_FILE = "vocab.safetensors"


@dataclass(frozen=True)
class VocabManifest:
    """A draft vocabulary: its size, the target's, the share of assistant tokens it covers, what it counted."""

    VERSION = VERSION

    kind: str
    draft_vocab_size: int
    target_vocab_size: int
    file: str | None = field(default=None, metadata=OMIT)
    coverage: float | None = None  # written as null when no counts were kept
    rows: int | None = field(default=None, metadata=OMIT)
    tokens: int | None = field(default=None, metadata=OMIT)
    distinct_tokens: int | None = field(default=None, metadata=OMIT)
    target: str | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)

    @property
    def tensors_file(self) -> str:
        return self.file or VOCAB_FILE

    @classmethod
    def from_dict(cls, doc: dict[str, Any], file: Path | str = "manifest") -> VocabManifest:
        return decode(cls, doc, file, (KIND,))

    def to_dict(self) -> dict[str, Any]:
        return encode(self)


read = reader(VocabManifest, (KIND,), missing="missing (has the vocab stage run?)")


def write(path: Path, manifest: VocabManifest) -> None:
    write_doc(path, manifest.to_dict())
