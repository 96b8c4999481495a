"""The extraction store: hidden-state shards written by ``pipeline.stages.extract`` and read by ``pipeline.stages.train``.

One shard is one safetensors file holding a group of rows back to back (no padding on disk):

* ``aux``            (N, 3·H) bf16  — outputs of the three fused target layers, concatenated
* ``last_hidden``    (N, H)   bf16  — the target's final (normed) hidden state, for soft labels
* ``target_argmax``  (N,)     int32 — the target's greedy next token at each position
* ``input_ids`` (N,) int32, ``loss_mask`` (N,) int8, ``offsets`` (R+1,) int64 row boundaries

``manifest.json`` (kind ``hidden_states``; its definition: :mod:`pipeline.manifests.hidden_store`) lists the shards with rows, tokens and bytes, the aux
layer ids and the target; ``eval_shards`` (``eval-*.safetensors``, same layout) hold a few held-out rows
on which the train stage measures acceptance while it trains. In ``online`` mode the manifest stores no shards, only the tokenized
sources, and training runs the target itself. Shards are written to a temporary name and renamed,
so a killed extraction leaves whole shards only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.manifests import hidden_store as hs_manifest
from pipeline.manifests.base import ManifestError
from pipeline.manifests.hidden_store import HiddenStatesManifest
from pipeline.run.rundir.files import publish

KIND = hs_manifest.KIND
MODES = hs_manifest.MODES
FORMAT = 1
TENSORS = ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask", "offsets")


class StoreError(ValueError):
    pass


def bytes_per_token(hidden_size: int, n_aux: int = 3, dtype_bytes: int = 2) -> int:
    """Stored bytes per token: aux + final hidden in ``dtype``, plus ids, mask and argmax (9 B)."""
    return (n_aux + 1) * hidden_size * dtype_bytes + 4 + 1 + 4


def shard_name(i: int) -> str:
    return f"hs-{i:05d}.safetensors"


def eval_shard_name(i: int) -> str:
    """Held-out rows, stored like training rows but never trained on (acceptance while training)."""
    return f"eval-{i:05d}.safetensors"


def is_eval_shard(name: str) -> bool:
    return name.startswith("eval-")


def write_shard(path: Path, rows: list[dict[str, torch.Tensor]], ids: list[str]) -> int:
    """Write one shard atomically; returns its size in bytes."""
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
    publish(tmp, path)
    return path.stat().st_size


@dataclass
class Sample:
    aux: torch.Tensor
    last_hidden: torch.Tensor
    target_argmax: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


_NP_DTYPES = {
    "BF16": ("<i2", torch.bfloat16),
    "F16": ("<f2", torch.float16),
    "F32": ("<f4", torch.float32),
    "I8": ("i1", torch.int8),
    "I32": ("<i4", torch.int32),
    "I64": ("<i8", torch.int64),
}


class ShardMap:
    """One shard memory-mapped once: each stored tensor as a zero-copy torch view of the file.

    A row is a contiguous byte range of every tensor, so reading it is one ``memcpy`` per tensor
    straight from the page cache into the batch buffer (no per-row tensor objects, no lazy
    ``get_slice`` round trips). The mapping is private (copy-on-write): nothing can write the file.
    """

    def __init__(self, path: Path) -> None:
        import mmap

        import numpy as np

        self.path = path
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            size = os.fstat(fh.fileno()).st_size
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        missing = [t for t in TENSORS if t not in header]
        if missing:
            raise StoreError(f"{path}: missing tensors {missing}")
        base = 8 + n
        self.tensors: dict[str, torch.Tensor] = {}
        for name in TENSORS:
            info = header[name]
            if info["dtype"] not in _NP_DTYPES:
                raise StoreError(
                    f"{path}: tensor {name} has dtype {info['dtype']}, not one this store writes"
                )
            np_dt, t_dt = _NP_DTYPES[info["dtype"]]
            a, b = info["data_offsets"]
            if base + b > size:
                raise StoreError(f"{path}: tensor {name} runs past the end of the file (truncated shard?)")
            shape = tuple(info["shape"])
            if b == a:
                self.tensors[name] = torch.empty(shape, dtype=t_dt)
                continue
            assert self._map is not None  # a file of size 0 has no tensors to read
            arr = np.frombuffer(
                self._map, dtype=np_dt, count=(b - a) // np.dtype(np_dt).itemsize, offset=base + a
            )
            self.tensors[name] = torch.from_numpy(arr.reshape(shape)).view(t_dt)


class HiddenStore:
    """Random access to the rows of an offline extraction, read from memory-mapped shards."""

    def __init__(self, out_dir: Path, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir)
        if self.manifest.mode != "offline":
            raise StoreError(
                f"{self.dir / 'manifest.json'}: mode is {self.manifest.mode!r}; no shards stored"
            )
        self.shards: list[ShardMap] = []
        self.index: list[tuple[int, int, int]] = []  # (file, start, end)
        self.ids: list[str] = []
        for fi, s in enumerate(self.manifest.shards_of(split)):
            p = self.dir / s.file
            if not p.is_file():
                raise StoreError(f"{self.dir / 'manifest.json'}: shard {s.file} is missing")
            try:
                m = ShardMap(p)
            except StoreError:
                raise
            except (ValueError, OSError) as exc:
                raise StoreError(f"{p}: not a readable shard: {exc}") from None
            off = m.tensors["offsets"]
            self.ids.extend(json.loads(m.metadata.get("ids", "[]")))
            self.shards.append(m)
            self.index.extend((fi, int(off[i]), int(off[i + 1])) for i in range(off.numel() - 1))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest.aux_layer_ids)

    def length(self, i: int) -> int:
        _, a, b = self.index[i]
        return b - a

    def view(self, i: int, name: str) -> torch.Tensor:
        """Row ``i`` of tensor ``name``: a view of the mapped file (copy it before keeping it)."""
        fi, a, b = self.index[i]
        return self.shards[fi].tensors[name][a:b]

    def __getitem__(self, i: int) -> Sample:
        return Sample(
            *(
                self.view(i, name).clone()
                for name in ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask")
            )
        )


def read_manifest(out_dir: Path) -> HiddenStatesManifest:
    """The extraction's manifest (:mod:`pipeline.manifests.hidden_store`); a damaged one is a :class:`StoreError`."""
    try:
        return hs_manifest.read(Path(out_dir) / "manifest.json")
    except ManifestError as exc:
        raise StoreError(str(exc)) from None
