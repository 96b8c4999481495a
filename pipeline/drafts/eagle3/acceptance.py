"""Acceptance while training: the accept length the draft would reach, simulated on held-out rows.

Loss keeps falling after acceptance has peaked (users of EAGLE-3 trainers report it), so the train stage
measures what matters every few steps: for every held-out position, the draft's own TTT chain predicts the
next ``spec_steps`` tokens and the target's stored greedy tokens verify them, as SGLang's chain
speculation with ``--speculative-num-steps spec_steps`` (top-k 1) does. The accept length at a position
is 1 (the target's own token) plus the number of leading draft tokens that equal the target's; the
result is its mean over the held-out positions whose first draft token is an assistant token.

It is a simulation: the chain is fed the row's tokens, not the draft's own guesses, so it agrees with a
real decode where the data is the target's own greedy output (what the regen stage produces).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.drafts.acceptance import mean_accept_length
from pipeline.drafts.batch import Batch
from pipeline.eagle3.draft_model import Eagle3Draft, shift_left


def accept_sums(draft: Eagle3Draft, b: Batch, spec_steps: int, autocast: bool) -> tuple[float, int]:
    """(sum of simulated accept lengths, number of positions) over one batch."""
    with torch.no_grad(), torch.autocast(b.aux.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = draft(b.aux, b.input_ids, b.lengths, spec_steps)
    start = b.step_mask(0)
    alive = start.clone()
    accepted = torch.ones_like(b.input_ids, dtype=torch.float64)
    for j, lj in enumerate(logits):
        guess = draft.draft_to_target(lj.float().argmax(-1))
        alive &= (guess == shift_left(b.target_argmax, 1 + j)) & b.step_mask(j)
        accepted += alive
    return float(accepted[start].sum()), int(start.sum())


def simulated_accept_length(
    draft: Eagle3Draft,
    data: Any,
    rows: list[int],
    device: torch.device,
    dtype: torch.dtype,
    spec_steps: int,
    micro_batch: int,
    autocast: bool,
) -> float:
    """Mean simulated accept length of ``draft`` over ``rows`` of ``data`` (``batches.OfflineData``/``OnlineData``)."""
    return mean_accept_length(
        draft, data, rows, device, dtype, micro_batch, lambda b: accept_sums(draft, b, spec_steps, autocast)
    )
