"""One training step and what happens at it: the update over the rank's micro-batches, the metrics, the
checkpoint and the acceptance evaluation that may keep the draft as the best (see :mod:`pipeline.stages.train`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.drafts.batch import Batch
from pipeline.drafts.registry import DraftLoss, TrainedDraft
from pipeline.run.stage_side.ranks import Dist
from pipeline.run.stage_side.runtime import StageContext
from pipeline.stages.train.checkpoints import StepLog
from pipeline.stages.train.components import (
    Checkpointer,
    Evaluator,
    MetricReporter,
    Optimiser,
    Runtime,
    TrainData,
)
from pipeline.stages.train.plateau import Plateau
from pipeline.stages.train.settings import BatchSchedule


def rank_chunks(all_idx: list[int], rank: int, world: int, length: Any, micro_batch: int) -> list[list[int]]:
    """Rank ``rank``'s slice of a step's global batch, longest first, in micro-batches."""
    idx = sorted(all_idx[rank::world], key=lambda i: (-length(i), i))
    return [idx[a : a + micro_batch] for a in range(0, len(idx), micro_batch)]


@dataclass
class Steps:
    """A training step and what happens at it — the update, the checkpoint, the evaluation — over the
    trainer's parts (:mod:`.components`), given by keyword."""

    runtime: Runtime
    data: TrainData
    draft: TrainedDraft
    loss: DraftLoss  # the draft method's objective (EAGLE-3's training-time test, DFlash's blocks, ...)
    optim: Optimiser
    checkpointer: Checkpointer
    evaluator: Evaluator
    metrics: MetricReporter
    schedule: BatchSchedule  # which rows each step trains on
    feeder: Any  # this rank's micro-batches of a step (assembled ahead on a GPU, or inline)
    micro_batch: int
    steps_log: StepLog | None  # rank 0: the rows of every step
    plateau: Plateau = field(default_factory=lambda: Plateau(0))  # early stopping on the accept length

    def batches(self, step: int, all_idx: list[int]) -> list[Batch]:
        rt, dist = self.runtime, self.runtime.dist
        if not self.data.online_tp:
            return self.feeder.next(step)
        # Every rank runs the target over the whole global batch (its tensor-parallel shard of
        # each layer), rank by rank, and keeps its own slice: the same target work on every rank.
        mine = []
        for r in range(dist.world):
            for c in rank_chunks(all_idx, r, dist.world, self.data.source.length, self.micro_batch):
                b = self.data.source.batch(c, rt.device, rt.dtype)
                if r == dist.rank:
                    mine.append(b)
        return mine

    def run(self, step: int) -> None:
        rt = self.runtime
        dist, device, k = rt.dist, rt.device, self.loss.ttt_steps
        if dist.any(rt.plan_ctx.pause_requested(), device):
            wait_paused(rt.ctx, rt.plan_ctx, dist, device)
        t0 = time.monotonic()
        all_idx = self.schedule.rows(step)
        batches = self.batches(step, all_idx)
        counts = dist.sum(self.loss.counts(batches, device))
        denom = counts.clamp(min=1)
        lr = self.optim.begin(step)
        loss_sums = torch.zeros(k, dtype=torch.float64, device=device)
        correct = torch.zeros(k, dtype=torch.float64, device=device)
        for bi, b in enumerate(batches):
            sync = bi == len(batches) - 1 or dist.world == 1
            ctxm = self.draft.model.no_sync() if (dist.world > 1 and not sync) else _null()
            with ctxm:
                losses, corr = self.loss.sums(self.draft, b)
                (self.loss.weighted(losses, denom) * dist.world).backward()
            loss_sums += torch.stack([x.detach().double() for x in losses])
            correct += corr
        self.optim.finish()
        if self.steps_log is not None:
            self.steps_log.record(step, [self.data.source.row_id(i) for i in all_idx])
        tokens = torch.tensor(
            [float(sum(int(b.lengths.sum()) for b in batches))], dtype=torch.float64, device=device
        )
        stats = dist.sum(torch.cat([loss_sums, correct, tokens]))
        dt = time.monotonic() - t0
        self.metrics.step(
            step,
            loss=sum((self.loss.decay**j) * float(stats[j] / denom[j]) for j in range(k)),
            accs=[float(stats[k + j] / denom[j]) for j in range(k)],
            lr=lr,
            tokens_per_s=float(stats[2 * k]) / max(dt, 1e-9),
        )

    def checkpoint(self, step: int) -> None:
        self.checkpointer.save(step, self.draft, self.optim)

    def eval_due(self, step: int) -> bool:
        return self.evaluator.due(step)

    def evaluate(self, step: int, saved: bool) -> bool:
        """Simulated accept length on the held-out rows (every rank computes it: online-TP captures together);
        rank 0 keeps the best draft. Only at a checkpointed step can it become the best: a resume never keeps a
        draft from steps it has lost. ``True`` when acceptance has been flat long enough to stop (every rank
        agrees: they stop together)."""
        acc = self.evaluator.accept_length(self.draft, self.runtime)
        if self.runtime.ctx:
            self.runtime.ctx.metric("accept_length", acc, step=step)
        if saved:
            self.checkpointer.keep_best(step, self.draft, acc, self.evaluator.spec_steps)
        flat = self.plateau.update(step, acc)
        if self.plateau.patience:
            flat = self.runtime.dist.any(flat, self.runtime.device)
        self.runtime.dist.barrier()
        return flat


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def wait_paused(ctx: StageContext | None, plan_ctx: StageContext, dist: Dist, device: torch.device) -> None:
    """All ranks pause together (a rank alone in a collective would hang) and resume together."""
    if ctx:
        ctx.message("paused at a safe point", code="paused")
    while dist.any(plan_ctx.pause_requested(), device):
        time.sleep(0.5)
    if ctx:
        ctx.message("resumed", code="resumed")
