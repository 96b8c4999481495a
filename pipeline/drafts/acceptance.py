"""The simulated accept length's mean over held-out rows, whatever the draft method: each method gives the
sums of one batch (:mod:`pipeline.drafts.eagle3.acceptance`, :mod:`pipeline.drafts.dflash.loss`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeline.drafts.batch import Batch


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
