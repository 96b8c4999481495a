"""A training batch as every draft method's loss and acceptance read it: the target's captured states of a
few padded rows (the train stage's data sources, offline or online, fill it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
