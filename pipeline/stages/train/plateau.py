"""Early stopping on acceptance: training stops when the simulated accept length has not improved for N evaluations.

Users saw acceptance peak (after ~4.6 epochs in one report) and then fall while the loss kept dropping: the steps
after the peak cost GPU-hours and make the draft worse. ``[train] stop_when_acceptance_flat = N`` stops the train
stage after N evaluations in a row without a new best (by more than ``acceptance_min_delta``); the best checkpoint
is then the draft, as always. A resumed attempt starts counting again from the best it kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Plateau:
    patience: int  # evaluations in a row without a new best that stop training; 0: never
    min_delta: float = 0.0  # an improvement smaller than this is not one
    best: float | None = None
    best_step: int | None = None
    flat: int = 0  # evaluations since the last new best

    def update(self, step: int, accept_length: float) -> bool:
        """Records the evaluation at ``step``; ``True`` when training should stop."""
        if self.best is None or accept_length > self.best + self.min_delta:
            self.best, self.best_step, self.flat = accept_length, step, 0
        else:
            self.flat += 1
        return self.patience > 0 and self.flat >= self.patience

    def reason(self) -> str:
        best = f"{self.best:.3f} at step {self.best_step}" if self.best is not None else "none"
        return f"the simulated accept length has not improved for {self.flat} evaluations (best {best})"
