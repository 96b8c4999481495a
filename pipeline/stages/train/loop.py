"""The training stage's program: find the inputs, build the draft, resume, run the steps and write the draft (see :mod:`pipeline.stages.train`).

The draft method (``[train] draft``) is looked up by name (:func:`pipeline.drafts.registry.draft_method`):
it builds the draft, gives the loss and the acceptance simulation, and saves the export; nothing here
branches on which method it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

import pipeline.stages.train as train_pkg
from pipeline import tested_versions
from pipeline.drafts.registry import BuildInputs, DraftLoss, DraftMethod, TrainedDraft, draft_method
from pipeline.eagle3 import draft_vocab
from pipeline.eagle3 import hidden_store as hs
from pipeline.run.plan.sections import TrainSection
from pipeline.run.stage_side.ranks import Dist, die_with_parent, reexec_under_torchrun
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.stages.train.batches import OfflineData
from pipeline.stages.train.checkpoints import STEPS_FILE, StepLog
from pipeline.stages.train.components import (
    Checkpointer,
    Evaluator,
    MetricReporter,
    Optimiser,
    Runtime,
    TrainData,
)
from pipeline.stages.train.feeder import Feeder, Inline
from pipeline.stages.train.inputs import Inputs, load_data
from pipeline.stages.train.output import finished_message, write_final_draft, write_manifest
from pipeline.stages.train.plateau import Plateau
from pipeline.stages.train.settings import BatchSchedule
from pipeline.stages.train.steps import Steps, rank_chunks


def pick_device(s: TrainSection, dist: Dist) -> torch.device:
    if s.device:
        dev = torch.device(s.device)
    else:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(dev)
    return dev


def make_runtime(ctx: StageContext | None, plan_ctx: StageContext, s: TrainSection, dist: Dist) -> Runtime:
    """This rank's device (the process group started on it, but for a tensor-parallel target on GPUs:
    transformers starts the group when it loads the target)."""
    device = pick_device(s, dist)
    if not (s.online_tp and device.type == "cuda"):
        dist.init(device)
    return Runtime(
        ctx=ctx,
        plan_ctx=plan_ctx,
        dist=dist,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.stages.train", description=train_pkg.__doc__.splitlines()[0]
    )
    add_common_args(ap)
    ap.add_argument(
        "--input", action="append", default=[], help="an upstream out dir (default: the stage's inputs)"
    )
    args = ap.parse_args(argv)
    dist = Dist()
    if dist.world > 1:
        die_with_parent()
    ctx = StageContext.from_cli(args) if dist.main else None
    plan_ctx = ctx or StageContext.from_cli(args)  # non-zero ranks read the plan, never emit
    s = plan_ctx.plan.settings.train
    plan = plan_ctx.plan
    if plan.target.engine == "sglang" and plan.settings.storage_mode == "online":  # capture while training
        refusal = tested_versions.stage_refusal(plan, "capture")
        if refusal:
            fail(ctx, f'{plan.path}: target.engine = "sglang": {refusal}', 2)
    if (s.nproc > 1 or s.target == "online-tp") and "LOCAL_RANK" not in os.environ:
        if ctx is not None:
            ctx.message(f"starting {s.nproc} processes under torchrun")
        reexec_under_torchrun(s.nproc, "pipeline.stages.train", argv, ctx)
    if dist.world != s.nproc and "LOCAL_RANK" in os.environ and ctx is not None:
        ctx.message(f"running with WORLD_SIZE={dist.world} (plan says nproc={s.nproc})", level="warning")
    inputs = (
        [Path(p) for p in args.input] if args.input else [plan_ctx.inputs[k] for k in sorted(plan_ctx.inputs)]
    )
    try:
        return train(ctx, plan_ctx, s, inputs, dist)
    except (ValueError, hs.StoreError, draft_vocab.VocabError) as exc:
        fail(ctx, str(exc))
    finally:
        dist.close()
    return 1


def train(
    ctx: StageContext | None,
    plan_ctx: StageContext,
    s: TrainSection,
    inputs: list[Path],
    dist: Dist,
) -> int:
    """Build the parts, resume, run the steps and write the finished draft (rank 0)."""
    plan = plan_ctx.plan
    found = Inputs.find(inputs, str(plan.target.model or ""), s)
    rt = make_runtime(ctx, plan_ctx, s, dist)
    method = draft_method(s.draft)
    vm = draft_vocab.load(found.vocab_dir)
    trc = plan.target.trust_remote_code
    td, loss = build_trained_draft(method, BuildInputs(found.model_id, found.aux, vm, s, trc), rt)
    data = load_data(
        rt,
        s,
        found.man,
        found.ext_dir,
        found.model_id,
        found.aux,
        plan.target.max_length,
        trc,
        plan.target.engine,
    )
    check_data(data, s, rt)
    optim = Optimiser.adamw(td.params, s)
    checkpointer = Checkpointer(
        out=plan_ctx.out,
        settings=s,
        extra={"world_size": dist.world, "aux_layer_ids": found.aux, "mode": data.mode},
        runtime=rt,
    )
    start = checkpointer.resume(td, optim)
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        td.model = DDP(
            td.draft,
            device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            broadcast_buffers=False,
        )
    td.draft.train()
    if ctx:
        ctx.message(
            f"training {sum(p.numel() for p in td.params) / 1e6:.1f}M parameters on {len(data.source):,} sequences "
            f"({'online, target tensor-parallel over the ranks' if s.online_tp else data.mode} data), "
            f"{dist.world} process(es) on {rt.device.type}, steps {start + 1}..{s.steps}, "
            + method.describe(s)
        )
        ctx.progress(start, s.steps, unit="steps", force=True)
    steps = make_steps(rt, s, data, td, loss, optim, checkpointer, start)
    last_saved, stopped = run_steps(steps, s, start, ctx)
    if ctx and rt.device.type == "cuda":
        ctx.metric("peak_memory_gib", torch.cuda.max_memory_allocated(rt.device) / 2**30)
    if dist.main:
        final = write_final_draft(
            method, td.draft, checkpointer.best, plan_ctx.out, found, s, data.mode, dist.world
        )
        write_manifest(
            plan_ctx.out,
            found,
            s,
            method,
            checkpointer.best,
            last_saved,
            stopped,
            vm.size,
            data.mode,
            dist.world,
        )
        if ctx:
            end = last_saved if stopped else s.steps
            ctx.progress(end, end, unit="steps", force=True)
            flags = method.serve_flags(s, plan.settings.deploy)
            ctx.message(finished_message(final, checkpointer.best, last_saved, flags))
    return 0


def build_trained_draft(method: DraftMethod, inp: BuildInputs, rt: Runtime) -> tuple[TrainedDraft, DraftLoss]:
    """The method's draft on this rank's device, its trained parameters and its loss."""
    built = method.build(inp)
    built.draft.to(rt.device)
    cols = None if built.aux_cols is None else built.aux_cols.to(rt.device)
    loss = method.loss(inp.settings, rt.autocast, cols)
    td = TrainedDraft(
        draft=built.draft,
        model=built.draft,
        head_d=built.head_d.to(rt.device),
        params=[p for p in built.draft.parameters() if p.requires_grad],
        head_full=built.head_full.to(rt.device) if loss.needs_full_head else None,
    )
    return td, loss


def check_data(data: TrainData, s: TrainSection, rt: Runtime) -> None:
    """Enough rows for a global batch split evenly over the ranks; a warning where acceptance cannot be tracked."""
    n, world = len(data.source), rt.dist.world
    if s.batch_size % world:
        raise ValueError(f"train.batch_size ({s.batch_size}) must be a multiple of the {world} processes")
    if n < s.batch_size:
        raise ValueError(f"only {n} training sequences but train.batch_size is {s.batch_size}")
    if rt.ctx and s.eval_interval and not data.eval_rows:
        rt.ctx.message(
            "no held-out rows in the extraction (extract.eval_rows = 0, bench.holdout = 0, or an extraction "
            "made before this version): acceptance is not tracked and draft/ is the last step",
            level="warning",
        )


def make_steps(
    rt: Runtime,
    s: TrainSection,
    data: TrainData,
    td: TrainedDraft,
    loss: DraftLoss,
    optim: Optimiser,
    checkpointer: Checkpointer,
    start: int,
) -> Steps:
    """The step runner over the parts, fed this rank's micro-batches from step ``start + 1`` on."""
    source, dist, device = data.source, rt.dist, rt.device
    n = len(source)
    schedule = BatchSchedule(
        n,
        s.batch_size,
        s.seed,
        [source.length(i) for i in range(n)] if s.length_grouping else None,
        s.length_grouping,
    )

    def my_chunks(step: int) -> list[list[int]]:
        return rank_chunks(schedule.rows(step), dist.rank, dist.world, source.length, s.micro_batch)

    feeder: Any = (
        Feeder(source, range(start + 1, s.steps + 1), my_chunks, device, rt.dtype, s.prefetch)
        if isinstance(source, OfflineData) and s.prefetch and device.type == "cuda"
        else Inline(source, my_chunks, device, rt.dtype)
    )
    steps = Steps(
        runtime=rt,
        data=data,
        draft=td,
        loss=loss,
        optim=optim,
        checkpointer=checkpointer,
        evaluator=Evaluator.from_settings(data, s, loss),
        metrics=MetricReporter(ctx=rt.ctx, log_every=s.log_every, last_step=s.steps, first_step=start + 1),
        schedule=schedule,
        feeder=feeder,
        micro_batch=s.micro_batch,
        steps_log=StepLog(rt.plan_ctx.out / STEPS_FILE, start) if dist.main else None,
        plateau=Plateau(s.stop_when_acceptance_flat, s.acceptance_min_delta),
    )
    best = checkpointer.best
    if best is not None:  # a resumed attempt counts from the best it kept
        steps.plateau.best, steps.plateau.best_step = best["accept_length"], best["step"]
    return steps


def run_steps(steps: Steps, s: TrainSection, start: int, ctx: StageContext | None) -> tuple[int, str | None]:
    """Steps ``start + 1`` to ``[train] steps``, checkpointed and evaluated when due, until the accept length
    stops rising; (the last step saved, why training stopped early or None)."""
    last_saved = start
    stopped: str | None = None
    best = steps.checkpointer.best
    if start and steps.eval_due(start) and (best is None or best["step"] < start):
        steps.evaluate(start, saved=True)  # killed between that checkpoint and its evaluation
    try:
        for step in range(start + 1, s.steps + 1):
            steps.run(step)
            if step % s.checkpoint_every == 0 or step == s.steps:
                steps.checkpoint(step)
                last_saved = step
            if steps.eval_due(step) and steps.evaluate(step, saved=last_saved == step):
                if last_saved != step:  # the last step trained is on disk too
                    steps.checkpoint(step)
                    last_saved = step
                stopped = f"stopped early at step {step} of {s.steps}: {steps.plateau.reason()}"
                if ctx:
                    ctx.message(stopped, level="warning", code="early_stop")
                break
    finally:
        steps.feeder.close()
    return last_saved, stopped
