"""The ``draft`` manifest: what the train stage writes beside ``draft/`` (which step it is and why, and the
recipe), and what the bench and serve stages read to load and judge the draft.

Required: ``kind`` and ``aux_layer_ids`` (what loading the draft needs). ``path`` (default ``draft``) is the
draft's folder, relative to the manifest's; ``draft`` (default ``eagle3``) names the draft method. Other
trainers (SpecForge's in bench/gpu, a hand-made manifest for an external draft) write a subset.

The draft method's own keys (what ``pipeline/drafts/<method>/method.py`` ``manifest()`` returns: ``block_size``,
``loss``; ``trainer`` for SpecForge) are not typed here: they sit at the top level of the file, as before, and
read into :attr:`DraftManifest.method`, an opaque dict, together with any key a newer writer added; every one
is written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.manifests.base import EXTRA, OMIT, decode, encode, reader, write_doc

VERSION = 1
KIND = "draft"
DRAFT_DIR = "draft"
DEFAULT_METHOD = "eagle3"


@dataclass(frozen=True)
class DraftManifest:
    """A trained draft: where it is, which step and why, the target and recipe, and the data it came from."""

    VERSION = VERSION

    kind: str
    aux_layer_ids: tuple[int, ...]
    path: str | None = field(default=None, metadata=OMIT)
    step: int | None = field(default=None, metadata=OMIT)
    last_step: int | None = field(default=None, metadata=OMIT)
    stopped_early: str | None = None  # why training ended before [train] steps
    chosen_by: str | None = field(default=None, metadata=OMIT)
    accept_length: float | None = None  # simulated on held-out rows, for the chosen step
    eval_spec_steps: int | None = None
    target: str | None = field(default=None, metadata=OMIT)
    steps_log: str | None = field(default=None, metadata=OMIT)
    draft_vocab_size: int | None = field(default=None, metadata=OMIT)
    draft: str | None = field(default=None, metadata=OMIT)  # the draft method's name
    ttt_steps: int | None = field(default=None, metadata=OMIT)
    fc_norm: bool | None = field(default=None, metadata=OMIT)
    norm_output: bool | None = field(default=None, metadata=OMIT)
    mode: str | None = field(default=None, metadata=OMIT)
    token_sources: tuple[str, ...] | None = field(default=None, metadata=OMIT)
    holdout: float | None = None
    max_length: int | None = None
    world_size: int | None = field(default=None, metadata=OMIT)
    provenance: str | None = field(default=None, metadata=OMIT)
    method: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)  # the draft method's keys, opaque

    @property
    def method_name(self) -> str:
        return self.draft or DEFAULT_METHOD

    def draft_path(self, train_dir: Path) -> Path:
        """The draft's folder (``path`` is relative to the manifest's folder, or absolute)."""
        return Path(train_dir) / (self.path or DRAFT_DIR)

    @property
    def source_dirs(self) -> list[Path]:
        return [Path(p) for p in self.token_sources or ()]

    @classmethod
    def from_dict(cls, doc: dict[str, Any], file: Path | str = "manifest") -> DraftManifest:
        return decode(cls, doc, file, (KIND,))

    def to_dict(self) -> dict[str, Any]:
        return encode(self)


read = reader(DraftManifest, (KIND,), missing="missing (has the train stage finished?)")


def write(path: Path, manifest: DraftManifest) -> None:
    write_doc(path, manifest.to_dict())
