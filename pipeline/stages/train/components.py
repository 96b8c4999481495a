"""The trainer's parts, each one job, built by keyword from ``[train]``: where it runs, the data source,
the draft under training, the loss, the optimiser and its schedule, the checkpointer, the evaluator and
the metric reporter. :class:`~pipeline.stages.train.steps.Steps` composes them; a new loss, draft type or
target engine is a new part here (or a new implementation of one), not a new argument threaded through
the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.drafts.batch import Batch
from pipeline.drafts.registry import DraftLoss, TrainedDraft, draft_method
from pipeline.run.plan.sections import TrainSection
from pipeline.run.stage_side.ranks import Dist
from pipeline.run.stage_side.runtime import StageContext
from pipeline.stages.train.checkpoints import (
    STATE_FILE,
    checkpoints,
    read_best,
    resume_problem,
    save_best,
    save_checkpoint,
)
from pipeline.stages.train.settings import lr_at


class DataSource(Protocol):
    """Training rows by index: the offline hidden-state store, or rows the target is run over online."""

    def __len__(self) -> int: ...

    def length(self, i: int) -> int: ...

    def row_id(self, i: int) -> str: ...

    def batch(self, idx: list[int], device: torch.device, dtype: torch.dtype) -> Batch: ...


@dataclass(frozen=True)
class Runtime:
    """Where the trainer runs: this rank, its device and compute dtype, and who may emit events."""

    ctx: StageContext | None  # the stage's events (rank 0); None on the other ranks
    plan_ctx: StageContext  # every rank: the plan, the out dir, pause requests
    dist: Dist
    device: torch.device
    dtype: torch.dtype

    @property
    def autocast(self) -> bool:
        """bf16 autocast over fp32 master weights on a GPU; plain fp32 on the CPU."""
        return self.device.type == "cuda"


@dataclass
class TrainData:
    """The data source and its held-out rows; ``online_tp``: every rank captures the whole global batch."""

    source: DataSource
    mode: str  # offline, online or online-tp (written into checkpoints and the manifest)
    online_tp: bool = False
    eval_source: DataSource | None = None
    eval_rows: list[int] = field(default_factory=list)


@dataclass
class Optimiser:
    """AdamW with linear warm-up and cosine decay (:func:`lr_at`), and gradient clipping."""

    opt: torch.optim.Optimizer
    settings: TrainSection
    params: list[torch.nn.Parameter]

    @classmethod
    def adamw(cls, params: list[torch.nn.Parameter], s: TrainSection) -> Optimiser:
        return cls(
            torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay), s, params
        )

    def begin(self, step: int) -> float:
        """Set step ``step``'s learning rate and clear the gradients; returns the rate."""
        lr = lr_at(step, self.settings)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        return lr

    def finish(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        self.opt.step()


@dataclass
class Checkpointer:
    """``checkpoints/step_N/`` (rank 0 writes, every rank waits), the resume from the newest, and ``best/``."""

    out: Path
    settings: TrainSection
    extra: dict[str, Any]  # recorded in every checkpoint: world size, aux layers, mode
    runtime: Runtime
    best: dict[str, Any] | None = None

    def resume(self, td: TrainedDraft, optim: Optimiser) -> int:
        """Load the newest checkpoint into the draft and the optimiser; the step it holds (0: none)."""
        start = 0
        found = checkpoints(self.out)
        if found:
            _step, path = found[-1]
            st = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
            problem = resume_problem(path, st, self.settings, set(td.draft.trainable_state()))
            if problem:
                raise ValueError(problem)
            td.draft.load_state_dict(st["model"], strict=False)
            optim.opt.load_state_dict(st["optimizer"])
            start = int(st["step"])
            if self.runtime.ctx:
                self.runtime.ctx.message(
                    f"resuming from checkpoint {path.name} (step {start})",
                    code="resumed_from_checkpoint",
                    step=start,
                )
        best = read_best(self.out)
        # A best chosen in an attempt whose steps after the checkpoint were lost is not this lineage.
        self.best = best if best is not None and best["step"] <= start else None
        return start

    def save(self, step: int, td: TrainedDraft, optim: Optimiser) -> None:
        rt = self.runtime
        if rt.dist.main:
            p = save_checkpoint(self.out, step, td.draft, optim.opt, self.settings, self.extra)
            if rt.ctx:
                rt.ctx.message(f"checkpoint {p.name}", code="checkpoint", step=step)
        rt.dist.barrier()

    def keep_best(self, step: int, td: TrainedDraft, accept_length: float, spec_steps: int) -> None:
        """The draft at ``step`` becomes the best if its accept length beats the best so far."""
        if self.best is not None and accept_length <= self.best["accept_length"]:
            return
        self.best = {"step": step, "accept_length": accept_length, "spec_steps": spec_steps}
        rt = self.runtime
        if rt.dist.main:
            save_best(self.out, td.draft, self.best, draft_method(self.settings.draft).export)
            if rt.ctx:
                rt.ctx.message(
                    f"best draft so far: step {step}, simulated accept length {accept_length:.3f} "
                    f"(steps = {spec_steps})",
                    code="best_draft",
                    step=step,
                )


@dataclass(frozen=True)
class Evaluator:
    """Simulated accept length on held-out rows, every ``interval`` steps and at the last."""

    data: TrainData
    spec_steps: int
    micro_batch: int
    interval: int  # 0: never
    last_step: int
    loss: DraftLoss  # the draft method's objective: it simulates the accept length too

    @classmethod
    def from_settings(cls, data: TrainData, s: TrainSection, loss: DraftLoss) -> Evaluator:
        return cls(
            data=data,
            spec_steps=s.spec_steps,
            micro_batch=s.micro_batch,
            interval=s.eval_interval,
            last_step=s.steps,
            loss=loss,
        )

    def due(self, step: int) -> bool:
        return (
            bool(self.data.eval_rows)
            and self.interval > 0
            and (step % self.interval == 0 or step == self.last_step)
        )

    def accept_length(self, td: TrainedDraft, rt: Runtime) -> float:
        return self.loss.accept_length(
            td.draft,
            self.data.eval_source,
            self.data.eval_rows,
            rt.device,
            rt.dtype,
            self.spec_steps,
            self.micro_batch,
        )


@dataclass(frozen=True)
class MetricReporter:
    """A step's metrics as events (rank 0): every ``log_every`` steps, the attempt's first and the last."""

    ctx: StageContext | None
    log_every: int
    last_step: int
    first_step: int  # this attempt's first step: always logged, so a resumed curve continues at once

    def step(self, step: int, loss: float, accs: list[float], lr: float, tokens_per_s: float) -> None:
        ctx = self.ctx
        if not ctx or not (step % self.log_every == 0 or step == self.last_step or step == self.first_step):
            return
        ctx.metric("loss", loss, step=step)
        for j, a in enumerate(accs):
            ctx.metric(f"acc_{j}", a, step=step)
        ctx.metric("lr", lr, step=step)
        ctx.metric("tokens_per_s", tokens_per_s, step=step)
        ctx.progress(step, self.last_step, unit="steps")
