"""The extraction store: hidden-state shards written by ``pipeline.stages.extract`` and read by ``pipeline.stages.train``.

One shard is one safetensors file holding a group of rows back to back (no padding on disk):

* ``aux``            (N, 3·H) bf16  — outputs of the three fused target layers, concatenated
* ``last_hidden``    (N, H)   bf16  — the target's final (normed) hidden state, for soft labels
* ``target_argmax``  (N,)     int32 — the target's greedy next token at each position
* ``input_ids`` (N,) int32, ``loss_mask`` (N,) int8, ``offsets`` (R+1,) int64 row boundaries

``manifest.json`` (kind ``hidden_states``) lists the shards with rows, tokens and bytes, the aux
layer ids and the target. In ``online`` mode the manifest stores no shards, only the tokenized
sources, and training runs the target itself. Shards are written to a temporary name and renamed,
so a killed extraction leaves whole shards only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KIND = "hidden_states"
MODES = ("offline", "online")
FORMAT = 1
TENSORS = ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask", "offsets")


class StoreError(ValueError):
    pass


def storage_mode(plan: Any) -> str:
    """``[extract] mode`` (``offline`` stores hidden states, ``online`` stores nothing).

    ``[train] mode`` is accepted as the same switch; the two must agree when both are set.
    """
    ex = plan.section("extract").get("mode")
    tr = plan.section("train").get("mode")
    for key, v in (("extract.mode", ex), ("train.mode", tr)):
        if v is not None and v not in MODES:
            raise StoreError(f"{plan.path}: {key}: expected one of {', '.join(MODES)}, got {v!r}")
    if ex is not None and tr is not None and ex != tr:
        raise StoreError(f"{plan.path}: extract.mode is {ex!r} but train.mode is {tr!r}; set one")
    if plan.section("train").get("target") == "online-tp":
        if ex == "offline" or tr == "offline":
            raise StoreError(f"{plan.path}: train.target = \"online-tp\" captures during training; "
                             "extract.mode = \"offline\" would store what it never reads: drop it")
        return "online"
    return ex or tr or "offline"


def bytes_per_token(hidden_size: int, n_aux: int = 3, dtype_bytes: int = 2) -> int:
    """Stored bytes per token: aux + final hidden in ``dtype``, plus ids, mask and argmax (9 B)."""
    return (n_aux + 1) * hidden_size * dtype_bytes + 4 + 1 + 4


def shard_name(i: int) -> str:
    return f"hs-{i:05d}.safetensors"


def write_shard(path: Path, rows: list[dict[str, torch.Tensor]], ids: list[str]) -> int:
    """Write one shard atomically; returns its size in bytes."""
    import os

    from safetensors.torch import save_file

    lengths = [int(r["input_ids"].shape[0]) for r in rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "aux": torch.cat([r["aux"] for r in rows]).to(torch.bfloat16).contiguous(),
        "last_hidden": torch.cat([r["last_hidden"] for r in rows]).to(torch.bfloat16).contiguous(),
        "target_argmax": torch.cat([r["target_argmax"] for r in rows]).to(torch.int32).contiguous(),
        "input_ids": torch.cat([r["input_ids"] for r in rows]).to(torch.int32).contiguous(),
        "loss_mask": torch.cat([r["loss_mask"] for r in rows]).to(torch.int8).contiguous(),
        "offsets": offsets,
    }
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"ids": json.dumps(ids), "format": str(FORMAT)})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


@dataclass
class Sample:
    aux: torch.Tensor
    last_hidden: torch.Tensor
    target_argmax: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class HiddenStore:
    """Random access to the rows of an offline extraction (slices are read lazily from the files)."""

    def __init__(self, out_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir)
        if self.manifest.get("mode") != "offline":
            raise StoreError(f"{self.dir / 'manifest.json'}: mode is {self.manifest.get('mode')!r}; no shards stored")
        self._files = []
        self.index: list[tuple[int, int, int]] = []  # (file, start, end)
        self.ids: list[str] = []
        for fi, s in enumerate(self.manifest["shards"]):
            p = self.dir / s["file"]
            if not p.is_file():
                raise StoreError(f"{self.dir / 'manifest.json'}: shard {s['file']} is missing")
            f = safe_open(str(p), framework="pt")
            missing = [t for t in TENSORS if t not in f.keys()]  # noqa: SIM118 - safe_open has no __contains__
            if missing:
                raise StoreError(f"{p}: missing tensors {missing}")
            off = f.get_tensor("offsets")
            self.ids.extend(json.loads((f.metadata() or {}).get("ids", "[]")))
            self._files.append(f)
            self.index.extend((fi, int(off[i]), int(off[i + 1])) for i in range(off.numel() - 1))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest["aux_layer_ids"])

    def length(self, i: int) -> int:
        _, a, b = self.index[i]
        return b - a

    def __getitem__(self, i: int) -> Sample:
        fi, a, b = self.index[i]
        f = self._files[fi]
        return Sample(*(f.get_slice(name)[a:b] for name in ("aux", "last_hidden", "target_argmax",
                                                           "input_ids", "loss_mask")))


def read_manifest(out_dir: Path) -> dict[str, Any]:
    p = Path(out_dir) / "manifest.json"
    try:
        man = json.loads(p.read_text())
    except FileNotFoundError:
        raise StoreError(f"{p}: missing (has the extract stage finished?)") from None
    except ValueError as exc:
        raise StoreError(f"{p}: not valid JSON: {exc}") from None
    if man.get("kind") != KIND:
        raise StoreError(f"{p}: kind is {man.get('kind')!r}, expected {KIND!r}")
    if man.get("mode") not in MODES:
        raise StoreError(f"{p}: mode is {man.get('mode')!r}, expected one of {', '.join(MODES)}")
    return man
