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

from collections.abc import Callable
from typing import Any

import torch

from pipeline.eagle3.draft_model import Eagle3Draft, shift_left
from pipeline.stages.train.batches import Batch


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


def mean_accept_length(
    draft: torch.nn.Module,
    data: Any,
    rows: list[int],
    device: torch.device,
    dtype: torch.dtype,
    micro_batch: int,
    sums: Callable[[Batch], tuple[float, int]],
) -> float:
    """The mean of ``sums`` (a draft kind's sum of accept lengths and count of positions in one batch) over
    ``rows`` of ``data``, longest rows first, ``micro_batch`` at a time, with ``draft`` in eval mode."""
    was_training = draft.training
    draft.eval()
    total, count = 0.0, 0
    try:
        order = sorted(rows, key=lambda i: (-data.length(i), i))
        for a in range(0, len(order), micro_batch):
            s, n = sums(data.batch(order[a : a + micro_batch], device, dtype))
            total, count = total + s, count + n
    finally:
        draft.train(was_training)
    if count == 0:
        raise ValueError("the held-out rows have no assistant tokens to predict")
    return total / count


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
