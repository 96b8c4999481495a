"""The ``bench`` manifest: the summary the bench stage writes (``results.json`` beside it holds every prompt's
or batch's line), offline (speculative decoding here: accept length and its histogram) or online (a running
SGLang server: tok/s and accept length per batch), and beside it the train stage's simulated accept length for
the same draft (``accept_gap``; the supervisor's ``accept-gap`` alert reads the stage's matching event). The
console and people read it, so it is typed like every other manifest.

Required: ``kind``, ``mode`` and ``accept_len`` (null online when the server reports no verify steps). The keys
of either mode are typed and optional; unknown keys stay in ``extra`` and are written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.manifests.base import EXTRA, OMIT, ManifestError, decode, encode, reader, write_doc

VERSION = 1
KIND = "bench"
MODES = ("offline", "online")


@dataclass(frozen=True)
class BenchManifest:
    """A benchmark's summary: the accept length, and the mode's own figures."""

    VERSION = VERSION

    kind: str
    mode: str
    accept_len: float | None
    # offline
    accept_rate: float | None = field(default=None, metadata=OMIT)
    max_accept_len: int | None = field(default=None, metadata=OMIT)
    steps: int | None = field(default=None, metadata=OMIT)
    prompts: int | None = field(default=None, metadata=OMIT)
    verify_steps: int | None = field(default=None, metadata=OMIT)
    new_tokens: int | None = field(default=None, metadata=OMIT)
    accepted_histogram: tuple[int, ...] | None = field(default=None, metadata=OMIT)
    elapsed_s: float | None = field(default=None, metadata=OMIT)
    draft: str | None = field(default=None, metadata=OMIT)  # the draft's folder
    draft_kind: str | None = field(default=None, metadata=OMIT)  # its method
    lossless_checked: bool | None = field(default=None, metadata=OMIT)
    lossless_mismatches: int | None = None
    # online
    label: str | None = field(default=None, metadata=OMIT)
    url: str | None = field(default=None, metadata=OMIT)
    max_new_tokens: int | None = field(default=None, metadata=OMIT)
    batches: tuple[dict[str, Any], ...] | None = field(default=None, metadata=OMIT)  # one line per batch size
    output_tok_s: float | None = field(default=None, metadata=OMIT)
    requests: int | None = field(default=None, metadata=OMIT)
    completion_tokens: int | None = field(default=None, metadata=OMIT)
    speedup: float | None = field(default=None, metadata=OMIT)
    # the train-versus-serve gap (pipeline/stages/bench/gap.py): simulated, served, where each came from
    accept_gap: dict[str, Any] | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=EXTRA)

    def _check(self, file: Path | str, prefix: str) -> None:
        if self.mode not in MODES:
            raise ManifestError(
                file, prefix + "mode", f"is {self.mode!r}, expected one of {', '.join(MODES)}"
            )

    @classmethod
    def from_dict(cls, doc: dict[str, Any], file: Path | str = "manifest") -> BenchManifest:
        return decode(cls, doc, file, (KIND,))

    def to_dict(self) -> dict[str, Any]:
        return encode(self)


read = reader(BenchManifest, (KIND,), missing="missing (has the bench stage finished?)")


def write(path: Path, manifest: BenchManifest) -> None:
    write_doc(path, manifest.to_dict())
