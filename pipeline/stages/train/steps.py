"""One training step and what happens at it: the update over the rank's micro-batches, the metrics, the
checkpoint and the acceptance evaluation that may keep the draft as the best (see :mod:`pipeline.stages.train`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.eagle3.draft_model import Eagle3Draft
from pipeline.run.plan_sections import TrainSection
from pipeline.run.ranks import Dist
from pipeline.run.runtime import StageContext
from pipeline.stages.train.acceptance import simulated_accept_length
from pipeline.stages.train.batches import Batch
from pipeline.stages.train.checkpoints import StepLog, save_best, save_checkpoint
from pipeline.stages.train.loss import counts_of, ttt_sums
from pipeline.stages.train.settings import BatchSchedule, lr_at


def rank_chunks(all_idx: list[int], rank: int, world: int, length: Any, micro_batch: int) -> list[list[int]]:
    """Rank ``rank``'s slice of a step's global batch, longest first, in micro-batches."""
    idx = sorted(all_idx[rank::world], key=lambda i: (-length(i), i))
    return [idx[a : a + micro_batch] for a in range(0, len(idx), micro_batch)]


@dataclass
class Steps:
    """Everything a training step needs, and what happens at a step: the update, the checkpoint, the evaluation."""

    ctx: StageContext | None
    plan_ctx: StageContext
    s: TrainSection
    dist: Dist
    device: torch.device
    dtype: torch.dtype
    data: Any
    online_tp: bool
    model: Any  # the draft, or DDP around it
    draft: Eagle3Draft
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    head_d: torch.Tensor
    autocast: bool
    steps_log: StepLog | None
    out: Path
    extra: dict[str, Any]
    schedule: BatchSchedule
    feeder: Any
    eval_data: Any
    eval_rows: list[int]
    best: dict[str, Any] | None
    first: int  # this attempt's first step (always logged)

    def batches(self, step: int, all_idx: list[int]) -> list[Batch]:
        s, dist = self.s, self.dist
        if not self.online_tp:
            return self.feeder.next(step)
        # Every rank runs the target over the whole global batch (its tensor-parallel shard of
        # each layer), rank by rank, and keeps its own slice: the same target work on every rank.
        mine = []
        for r in range(dist.world):
            for c in rank_chunks(all_idx, r, dist.world, self.data.length, s.micro_batch):
                b = self.data.batch(c, self.device, self.dtype)
                if r == dist.rank:
                    mine.append(b)
        return mine

    def run(self, step: int) -> None:
        s, dist, ctx, device = self.s, self.dist, self.ctx, self.device
        if dist.any(self.plan_ctx.pause_requested(), device):
            wait_paused(ctx, self.plan_ctx, dist, device)
        t0 = time.monotonic()
        all_idx = self.schedule.rows(step)
        batches = self.batches(step, all_idx)
        counts = dist.sum(counts_of(batches, s.ttt_steps, device))
        denom = counts.clamp(min=1)
        lr = lr_at(step, s)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss_sums = torch.zeros(s.ttt_steps, dtype=torch.float64, device=device)
        correct = torch.zeros(s.ttt_steps, dtype=torch.float64, device=device)
        for bi, b in enumerate(batches):
            sync = bi == len(batches) - 1 or dist.world == 1
            ctxm = self.model.no_sync() if (dist.world > 1 and not sync) else _null()
            with ctxm:
                losses, corr = ttt_sums(
                    self.model, self.draft, b, self.head_d, s.ttt_steps, self.autocast, s.loss_chunk_tokens
                )
                total = sum((s.loss_decay**j) * losses[j] / denom[j] for j in range(s.ttt_steps))
                (total * dist.world).backward()
            loss_sums += torch.stack([x.detach().double() for x in losses])
            correct += corr
        torch.nn.utils.clip_grad_norm_(self.params, s.max_grad_norm)
        self.opt.step()
        if self.steps_log is not None:
            self.steps_log.record(step, [self.data.row_id(i) for i in all_idx])
        stats = dist.sum(
            torch.cat(
                [
                    loss_sums,
                    correct,
                    torch.tensor(
                        [float(sum(int(b.lengths.sum()) for b in batches))],
                        dtype=torch.float64,
                        device=device,
                    ),
                ]
            )
        )
        dt = time.monotonic() - t0
        k = s.ttt_steps
        step_loss = sum((s.loss_decay**j) * float(stats[j] / denom[j]) for j in range(k))
        if ctx and (step % s.log_every == 0 or step == s.steps or step == self.first):
            ctx.metric("loss", step_loss, step=step)
            for j in range(k):
                ctx.metric(f"acc_{j}", float(stats[k + j] / denom[j]), step=step)
            ctx.metric("lr", lr, step=step)
            ctx.metric("tokens_per_s", float(stats[2 * k]) / max(dt, 1e-9), step=step)
            ctx.progress(step, s.steps, unit="steps")

    def checkpoint(self, step: int) -> None:
        if self.dist.main:
            p = save_checkpoint(self.out, step, self.draft, self.opt, self.s, self.extra)
            if self.ctx:
                self.ctx.message(f"checkpoint {p.name}", code="checkpoint", step=step)
        self.dist.barrier()

    def eval_due(self, step: int) -> bool:
        every = self.s.eval_interval
        return bool(self.eval_rows) and every > 0 and (step % every == 0 or step == self.s.steps)

    def evaluate(self, step: int, saved: bool) -> None:
        """Simulated accept length on the held-out rows (every rank computes it: online-TP captures together);
        rank 0 keeps the best draft. Only at a checkpointed step can it become the best: a resume never keeps a
        draft from steps it has lost."""
        acc = simulated_accept_length(
            self.draft,
            self.eval_data,
            self.eval_rows,
            self.device,
            self.dtype,
            self.s.spec_steps,
            self.s.micro_batch,
            self.autocast,
        )
        if self.ctx:
            self.ctx.metric("accept_length", acc, step=step)
        if saved and (self.best is None or acc > self.best["accept_length"]):
            self.best = {"step": step, "accept_length": acc, "spec_steps": self.s.spec_steps}
            if self.dist.main:
                save_best(self.out, self.draft, self.best)
                if self.ctx:
                    self.ctx.message(
                        f"best draft so far: step {step}, simulated accept length {acc:.3f} "
                        f"(steps = {self.s.spec_steps})",
                        code="best_draft",
                        step=step,
                    )
        self.dist.barrier()


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
