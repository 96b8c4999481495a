"""The schedule ``[train]`` implies: learning rate per step and the samples of each step.

The settings themselves are :class:`pipeline.run.plan.sections.TrainSection`.
"""

from __future__ import annotations

import math

import torch

from pipeline.run.plan.sections import TrainSection


def lr_at(step: int, s: TrainSection) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step (1-based)."""
    if step <= s.warmup:
        return s.lr * step / max(1, s.warmup)
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def global_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The samples of (1-based) ``step``: a fresh seeded permutation per epoch, last partial batch dropped."""
    per_epoch = n // batch_size
    epoch, b = divmod(step - 1, per_epoch)
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[b * batch_size : (b + 1) * batch_size].tolist()


class BatchSchedule:
    """Which rows each (1-based) step trains on: deterministic from the seed, so a resume needs no sampler state.

    With ``window`` > 0 rows are grouped by length: each epoch's seeded permutation is cut into windows
    of ``window`` batches, each window sorted by length and cut into batches, and the epoch's batches
    shuffled (seeded) — batches of similar lengths pad little, and every row is still seen once per
    epoch in a random order of batches. ``window`` = 0 is the plain shuffle of :func:`global_indices`.
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, lengths: list[int] | None = None, window: int = 0
    ) -> None:
        if window and (lengths is None or len(lengths) != n):
            raise ValueError("length grouping needs every row's length")
        self.n, self.batch_size, self.seed, self.lengths, self.window = n, batch_size, seed, lengths, window
        self._epoch: tuple[int, list[list[int]]] | None = None

    def rows(self, step: int) -> list[int]:
        if not self.window:
            return global_indices(step, self.n, self.batch_size, self.seed)
        per_epoch = self.n // self.batch_size
        epoch, b = divmod(step - 1, per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches(epoch))
        return self._epoch[1][b]

    def _batches(self, epoch: int) -> list[list[int]]:
        assert self.lengths is not None
        lengths = self.lengths
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()[: (self.n // self.batch_size) * self.batch_size]
        span = self.window * self.batch_size
        batches: list[list[int]] = []
        for a in range(0, len(perm), span):
            win = sorted(perm[a : a + span], key=lambda i: lengths[i])  # stable: ties keep the random order
            batches += [win[k : k + self.batch_size] for k in range(0, len(win), self.batch_size)]
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[k] for k in order]
