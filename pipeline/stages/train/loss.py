"""One batch's training-time-test loss: soft-label cross-entropy per TTT step and greedy accuracy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pipeline.eagle3.draft_model import Eagle3Draft, shift_left
from pipeline.stages.train.batches import Batch


def counts_of(batches: list[Batch], steps: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([sum(int(b.step_mask(j).sum()) for b in batches) for j in range(steps)],
                        dtype=torch.float64, device=device)


def ttt_sums(model: Any, draft: Eagle3Draft, b: Batch, head_d: torch.Tensor, steps: int,
             autocast: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per TTT step: the summed soft-label CE (with grad) and the number of correct greedy tokens."""
    with torch.no_grad():
        tgt = (b.last_hidden.float() @ head_d.float().T).log_softmax(-1)  # target over the draft vocab
    with torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(b.aux, b.input_ids, b.lengths, steps)
    losses, correct = [], torch.zeros(steps, dtype=torch.float64, device=b.aux.device)
    for j, lj in enumerate(logits):
        lj = lj.float()
        m = b.step_mask(j)
        am = shift_left(b.target_argmax, 1 + j)
        p = shift_left(tgt, 1 + j).exp()
        in_vocab = draft.t2d[am]
        ce = -(p * F.log_softmax(lj, dim=-1)).sum(-1)
        losses.append((ce * (m & in_vocab)).sum())
        with torch.no_grad():
            guess = draft.draft_to_target(lj.argmax(-1))
            correct[j] = ((guess == am) & m).sum()
    return losses, correct
