"""Training batches: padded tensors from the hidden-state store (offline) or from the target run on the fly (online)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.drafts.batch import Batch
from pipeline.eagle3 import hidden_store as hs


def pad_stack(seqs: list[torch.Tensor], length: int, fill: float = 0) -> torch.Tensor:
    out = torch.full((len(seqs), length, *seqs[0].shape[1:]), fill, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


class OfflineData:
    """Batches from the hidden-state store: each row copied once, from the mapped shard into the batch.

    :meth:`host_batch` fills padded host tensors (pinned when the batch goes to a GPU, so the copy
    to the device can overlap compute); :meth:`batch` also moves it to the device. The store keeps
    bf16, and so does the host batch: on a GPU the step runs under bf16 autocast anyway.
    """

    def __init__(self, store: hs.HiddenStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def length(self, i: int) -> int:
        return self.store.length(i)

    def row_id(self, i: int) -> str:
        return self.store.ids[i]

    def host_batch(self, idx: list[int], pin: bool = False) -> Batch:
        lengths = [self.store.length(i) for i in idx]
        n = max(lengths)
        out = {}
        for name in ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask"):
            first = self.store.view(idx[0], name)
            buf = torch.zeros((len(idx), n, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            for k, i in enumerate(idx):
                buf[k, : lengths[k]].copy_(self.store.view(i, name))
            out[name] = buf
        return Batch(
            out["aux"],
            out["last_hidden"],
            out["target_argmax"],
            out["input_ids"],
            out["loss_mask"],
            torch.tensor(lengths),
        )

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch:
        return to_device(self.host_batch(idx, pin=device.type == "cuda"), device, dtype)


def to_device(b: Batch, device: torch.device, dtype: torch.dtype) -> Batch:
    """The batch on ``device`` (features in ``dtype``); non-blocking from pinned host memory."""
    nb = b.aux.is_pinned()
    return Batch(
        b.aux.to(device, dtype, non_blocking=nb),
        b.last_hidden.to(device, dtype, non_blocking=nb),
        b.target_argmax.to(device, torch.long, non_blocking=nb),
        b.input_ids.to(device, torch.long, non_blocking=nb),
        b.loss_mask.to(device, torch.bool, non_blocking=nb),
        b.lengths.to(device, non_blocking=nb),
    )


class OnlineData:
    """Runs the target over tokenized rows for every batch: nothing is stored."""

    def __init__(self, rows: list[Any], target: Any) -> None:
        self.rows = rows
        self.target = target

    def __len__(self) -> int:
        return len(self.rows)

    def length(self, i: int) -> int:
        return self.rows[i].num_tokens

    def row_id(self, i: int) -> str:
        return self.rows[i].id

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch:
        rows = [self.rows[i] for i in idx]
        n = max(r.num_tokens for r in rows)
        ids = pad_stack([torch.from_numpy(r.input_ids.astype("int64")) for r in rows], n).to(device)
        lengths = torch.tensor([r.num_tokens for r in rows], device=device)
        attn = (torch.arange(n, device=device)[None, :] < lengths[:, None]).long()
        cap = self.target.capture(ids.to(self.target.device), attention_mask=attn.to(self.target.device))
        am = self.target.argmax(cap.last_hidden).to(device)
        mask = pad_stack([torch.from_numpy(r.loss_mask) for r in rows], n).to(device, torch.bool)
        # Rounded through bf16 exactly as the offline store keeps them, so online and offline train on
        # the same numbers (on a GPU the target runs in bf16 anyway).
        aux, last = (t.to(device, torch.bfloat16).to(dtype) for t in (cap.aux, cap.last_hidden))
        return Batch(aux, last, am, ids, mask, lengths)
