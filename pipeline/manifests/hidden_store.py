"""The ``hidden_states`` manifest: what the extract stage writes over its hidden-state shards (the store's
layout: ``pipeline.eagle3.hidden_store``), and what the train stage (and SpecForge's trainer in bench/gpu) reads.

Required: ``kind``, ``mode`` (``offline``: shards stored; ``online``: nothing stored, ``row_ids`` and
``sources`` say which rows training runs the target over), ``aux_layer_ids`` and ``shards`` (empty online).
The rest of what extract writes is typed and optional; unknown keys stay in ``extra`` and are written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.manifests.base import EXTRA, OMIT, ManifestError, decode, encode, reader, write_doc

VERSION = 1
KIND = "hidden_states"
MODES = ("offline", "online")


@dataclass(frozen=True)
class StoredShard:
    """One hidden-state shard (``hs-*`` training rows, ``eval-*`` held-out rows): file, rows, tokens, bytes."""

    file: str
    rows: int | None = field(default=None, metadata=OMIT)
    tokens: int | None = field(default=None, metadata=OMIT)
    bytes: int | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)


@dataclass(frozen=True)
class HiddenStatesManifest:
    """An extraction: the target and its captured layers, the rows, and (offline) the shards holding them."""

    VERSION = VERSION

    kind: str
    mode: str
    aux_layer_ids: tuple[int, ...]
    shards: tuple[StoredShard, ...]
    eval_shards: tuple[StoredShard, ...] | None = field(default=None, metadata=OMIT)
    format: int | None = field(default=None, metadata=OMIT)  # the shard layout's own version
    target: str | None = field(default=None, metadata=OMIT)
    hidden_size: int | None = field(default=None, metadata=OMIT)
    num_layers: int | None = field(default=None, metadata=OMIT)
    sglang_layers_to_capture: tuple[int, ...] | None = field(default=None, metadata=OMIT)
    target_architecture: str | None = field(default=None, metadata=OMIT)
    dtype: str | None = field(default=None, metadata=OMIT)
    sources: tuple[str, ...] | None = field(default=None, metadata=OMIT)  # the tokenized out dirs read
    holdout: float | None = field(default=None, metadata=OMIT)
    max_length: int | None = None  # written as null when neither [extract] nor [target] sets one
    rows: int | None = field(default=None, metadata=OMIT)
    tokens: int | None = field(default=None, metadata=OMIT)
    eval_rows: int | None = field(default=None, metadata=OMIT)
    eval_tokens: int | None = field(default=None, metadata=OMIT)
    bytes: int | None = field(default=None, metadata=OMIT)
    row_ids: tuple[str, ...] | None = field(default=None, metadata=OMIT)  # online: the rows, training order
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)

    def _check(self, file: Path | str, prefix: str) -> None:
        if self.mode not in MODES:
            raise ManifestError(
                file, prefix + "mode", f"is {self.mode!r}, expected one of {', '.join(MODES)}"
            )

    @property
    def source_dirs(self) -> list[Path]:
        return [Path(p) for p in self.sources or ()]

    def shards_of(self, split: str) -> tuple[StoredShard, ...]:
        """The ``train`` shards or the ``eval`` (held-out) ones."""
        return self.shards if split == "train" else (self.eval_shards or ())

    @classmethod
    def from_dict(cls, doc: dict[str, Any], file: Path | str = "manifest") -> HiddenStatesManifest:
        return decode(cls, doc, file, (KIND,))

    def to_dict(self) -> dict[str, Any]:
        return encode(self)


read = reader(HiddenStatesManifest, (KIND,), missing="missing (has the extract stage finished?)")


def write(path: Path, manifest: HiddenStatesManifest) -> None:
    write_doc(path, manifest.to_dict())
