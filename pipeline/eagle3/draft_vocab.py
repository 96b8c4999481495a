"""The draft vocabulary: top-K target tokens by frequency, and the d2t / t2d maps SGLang expects.

Built as SpecForge's ``process_token_dict_to_mappings`` does: count the assistant tokens
(``input_ids[loss_mask == 1]``), keep the ``K`` most frequent (topping up with the lowest unused
ids when fewer than ``K`` distinct tokens occur), sort them, and store

* ``d2t[i] = used[i] - i`` (int64, length K): SGLang adds ``arange(K)`` to get the hot-token ids;
* ``t2d[t] = t in used`` (bool, length = target vocabulary).

Written by the vocab stage as ``vocab.safetensors`` next to a ``manifest.json`` of kind ``vocab`` (its
definition: :mod:`pipeline.manifests.vocab`);
read by training, which stores both as buffers of the draft checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.manifests import vocab as vocab_manifest
from pipeline.manifests.base import ManifestError

VOCAB_FILE = vocab_manifest.VOCAB_FILE
MANIFEST_KIND = vocab_manifest.KIND


class VocabError(ValueError):
    pass


@dataclass
class VocabMap:
    d2t: torch.Tensor  # (K,) int64 offsets
    t2d: torch.Tensor  # (V,) bool
    counts: torch.Tensor | None = None  # (V,) int64 token frequencies the map was built from

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id (``arange(K) + d2t``)."""
        return torch.arange(self.d2t.numel(), dtype=torch.int64) + self.d2t

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    def coverage(self, counts: torch.Tensor | np.ndarray | None = None) -> float:
        """Share of counted target tokens that fall inside the draft vocabulary."""
        c = self.counts if counts is None else torch.as_tensor(counts)
        if c is None:
            raise VocabError("no token counts to compute coverage from")
        total = int(c.sum())
        return float(c[self.t2d].sum()) / total if total else 0.0


def build(counts: np.ndarray | torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The top-``draft_vocab_size`` tokens of ``counts`` (one count per target id)."""
    c = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
    vocab = int(c.numel())
    k = int(draft_vocab_size)
    if k < 1:
        raise VocabError(f"draft_vocab_size must be at least 1, got {k}")
    if k > vocab:
        raise VocabError(f"draft_vocab_size {k} exceeds the target vocabulary ({vocab})")
    # Most frequent first; ties (and the zero-count top-up) go to the lowest id, as in SpecForge.
    idx = np.lexsort((np.arange(vocab), -c.numpy()))
    chosen = torch.from_numpy(np.sort(idx[:k])).to(torch.int64)
    d2t = chosen - torch.arange(k, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return VocabMap(d2t=d2t, t2d=t2d, counts=c)


def save(vm: VocabMap, out_dir: Path, extra: dict[str, Any] | None = None) -> Path:
    """``vocab.safetensors`` and its manifest; ``extra`` holds the manifest's other fields (rows, tokens, ...)."""
    from safetensors.torch import save_file

    from pipeline.run.rundir.layout import write_atomic

    out_dir = Path(out_dir)
    tensors = {"d2t": vm.d2t.contiguous(), "t2d": vm.t2d.contiguous()}
    if vm.counts is not None:
        tensors["counts"] = vm.counts.contiguous()
    tmp = out_dir / (VOCAB_FILE + ".partial")
    save_file(tensors, str(tmp))
    write_atomic(out_dir / VOCAB_FILE, tmp.read_bytes())
    tmp.unlink()
    manifest = vocab_manifest.VocabManifest(
        kind=MANIFEST_KIND,
        file=VOCAB_FILE,
        draft_vocab_size=vm.size,
        target_vocab_size=int(vm.t2d.numel()),
        coverage=vm.coverage() if vm.counts is not None else None,
        **(extra or {}),
    )
    vocab_manifest.write(out_dir / "manifest.json", manifest)
    return out_dir / VOCAB_FILE


def load(out_dir: Path) -> VocabMap:
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    mpath = out_dir / "manifest.json"
    try:
        man = vocab_manifest.read(mpath)
    except ManifestError as exc:
        raise VocabError(str(exc)) from None
    t = load_file(str(out_dir / man.tensors_file))
    for key in ("d2t", "t2d"):
        if key not in t:
            raise VocabError(f"{out_dir / VOCAB_FILE}: tensor {key!r} missing")
    vm = VocabMap(d2t=t["d2t"].to(torch.int64), t2d=t["t2d"].to(torch.bool), counts=t.get("counts"))
    check(vm, str(out_dir / VOCAB_FILE))
    return vm


def check(vm: VocabMap, where: str = "vocab") -> None:
    """d2t and t2d must describe the same sorted set of in-range target ids."""
    ids = vm.draft_ids
    vocab = int(vm.t2d.numel())
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise VocabError(f"{where}: d2t maps outside the target vocabulary (0..{vocab - 1})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise VocabError(f"{where}: draft ids are not strictly increasing target ids")
    if int(vm.t2d.sum()) != ids.numel() or not bool(vm.t2d[ids].all()):
        raise VocabError(f"{where}: t2d does not mark exactly the {ids.numel()} ids that d2t maps to")
