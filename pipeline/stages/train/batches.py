"""Training batches: padded tensors from the hidden-state store (offline) or from the target run on the fly (online)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.draft_model import shift_left


@dataclass
class Batch:
    aux: torch.Tensor  # (B, S, 3H)
    last_hidden: torch.Tensor  # (B, S, H)
    target_argmax: torch.Tensor  # (B, S) long
    input_ids: torch.Tensor  # (B, S) long
    loss_mask: torch.Tensor  # (B, S) bool
    lengths: torch.Tensor  # (B,)

    def step_mask(self, j: int) -> torch.Tensor:
        """Columns whose step-``j`` prediction (token ``t+2+j``) is an assistant token."""
        return shift_left(self.loss_mask, 2 + j, False)


def pad_stack(seqs: list[torch.Tensor], length: int, fill: float = 0) -> torch.Tensor:
    out = torch.full((len(seqs), length, *seqs[0].shape[1:]), fill, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


class OfflineData:
    def __init__(self, store: hs.HiddenStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def length(self, i: int) -> int:
        return self.store.length(i)

    def row_id(self, i: int) -> str:
        return self.store.ids[i]

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch:
        samples = [self.store[i] for i in idx]
        n = max(s.input_ids.shape[0] for s in samples)
        return Batch(
            pad_stack([s.aux for s in samples], n).to(device, dtype),
            pad_stack([s.last_hidden for s in samples], n).to(device, dtype),
            pad_stack([s.target_argmax for s in samples], n).to(device, torch.long),
            pad_stack([s.input_ids for s in samples], n).to(device, torch.long),
            pad_stack([s.loss_mask for s in samples], n).to(device, torch.bool),
            torch.tensor([s.input_ids.shape[0] for s in samples], device=device),
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
