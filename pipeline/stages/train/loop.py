"""The training stage's program: find the inputs, build the draft, resume, and run the steps (see :mod:`pipeline.stages.train`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import pipeline.stages.train as train_pkg
from pipeline.eagle3 import draft_vocab, provenance
from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.dflash_model import DFlashDraft
from pipeline.eagle3.draft_model import Eagle3Draft
from pipeline.eagle3.trainer_inputs import build_draft, find_inputs
from pipeline.run.files import swap_dir
from pipeline.run.plan_sections import TrainSection
from pipeline.run.ranks import Dist, die_with_parent, reexec_under_torchrun
from pipeline.run.rundir import write_json
from pipeline.run.runtime import StageContext, add_common_args, fail
from pipeline.stages.train.batches import OfflineData, OnlineData
from pipeline.stages.train.checkpoints import (
    BEST_DIR,
    FINAL_DIR,
    STEPS_FILE,
    StepLog,
    save_any,
)
from pipeline.stages.train.components import (
    Checkpointer,
    Evaluator,
    MetricReporter,
    Optimiser,
    Runtime,
    TrainData,
    TrainedDraft,
    TTTLoss,
)
from pipeline.stages.train.dflash_build import build_dflash
from pipeline.stages.train.dflash_loss import BlockLoss
from pipeline.stages.train.feeder import Feeder, Inline
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


def eagle31_note(s: TrainSection) -> str:
    """The startup note for the EAGLE-3.1 switches that are on, e.g. " (EAGLE-3.1: fc_norm)"; empty if none."""
    on = [k for k, v in (("fc_norm", s.draft_fc_norm), ("norm_output", s.draft_norm_output)) if v]
    return f" (EAGLE-3.1: {', '.join(on)})" if on else ""


def load_data(
    rt: Runtime,
    s: TrainSection,
    man: dict[str, Any],
    ext_dir: Path,
    model_id: str,
    aux: list[int],
    target_max_length: int | None,
    trust_remote_code: bool = False,
    engine: str = "transformers",
) -> TrainData:
    """The data source: the extraction's stored hidden states (offline), or its rows with the target run
    over them as training goes (online; tensor-parallel over the ranks under ``online-tp``; by SGLang's model
    runner in this process with ``engine = "sglang"``)."""
    online_tp = s.online_tp
    mode = "online-tp" if online_tp else str(man["mode"])
    if man["mode"] == "offline":
        data = TrainData(source=OfflineData(hs.HiddenStore(ext_dir)), mode=mode)
        if s.eval_interval and man.get("eval_shards"):
            data.eval_source = OfflineData(hs.HiddenStore(ext_dir, split="eval"))
    else:
        from pipeline.data.shards import iter_rows, training_order
        from pipeline.eagle3.target_capture import load_target

        max_len = man.get("max_length") or s.max_length or target_max_length
        wanted = set(man.get("row_ids") or [])
        rows = training_order(
            [
                r
                for r in iter_rows(
                    [Path(p) for p in man["sources"]], float(man.get("holdout", 0.0)), "train", None, max_len
                )
                if r.id in wanted
            ]
        )
        if len(rows) != len(wanted):
            raise ValueError(
                f"{ext_dir / 'manifest.json'}: lists {len(wanted)} rows but the sources now hold "
                f"{len(rows)} of them; rerun extraction with --fresh"
            )
        held: list[Any] = []
        if s.eval_interval and float(man.get("holdout") or 0) > 0:
            held = training_order(
                list(
                    iter_rows(
                        [Path(p) for p in man["sources"]], float(man["holdout"]), "heldout", None, max_len
                    )
                )
            )
            held = [r for r in held if r.num_tokens >= 2 and r.loss_mask.any()][: s.eval_rows]
        target: Any
        if engine == "sglang":  # the plan refuses it with online-tp and with several ranks
            from pipeline.eagle3.sglang_target import load_for_training

            longest = max(r.num_tokens for r in rows + held) if rows or held else 1
            target = load_for_training(
                model_id,
                aux,
                rt.device,
                longest,
                s.micro_batch,
                trust_remote_code,
                str(rt.plan_ctx.plan.path),
            )
            if rt.ctx:
                rt.ctx.message(
                    f"target loaded by SGLang's model runner in this process, capturing layers {aux}"
                )
        elif online_tp:
            target = load_target(
                model_id,
                aux,
                dtype=rt.dtype,
                device=rt.device,
                parallel="tp",
                trust_remote_code=trust_remote_code,
            )
            rt.dist.init(rt.device)  # a no-op where transformers started the group
        else:
            target = load_target(
                model_id, aux, dtype=rt.dtype, device=rt.device, trust_remote_code=trust_remote_code
            )
        data = TrainData(source=OnlineData(rows, target), mode=mode, online_tp=online_tp)
        data.eval_source = OnlineData(held, target) if held else None  # the same target, whichever engine
    if data.eval_source is not None:
        data.eval_rows = list(range(min(s.eval_rows, len(data.eval_source))))
    return data


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
    plan = plan_ctx.plan
    out = plan_ctx.out
    model_id = str(plan.target.model or "")
    man, ext_dir, vocab_dir = find_inputs(inputs)
    aux = list(man["aux_layer_ids"])
    if man.get("target") not in (None, model_id):
        raise ValueError(
            f"{ext_dir / 'manifest.json'}: extracted from {man.get('target')!r} but the plan's target is {model_id!r}"
        )
    online_tp = s.online_tp
    if online_tp and man["mode"] != "online":
        raise ValueError(
            f'{ext_dir / "manifest.json"}: train.target = "online-tp" needs the extraction in online mode '
            f"(rows only), but it stored hidden states ({man['mode']}); retry extract with --fresh"
        )
    device = pick_device(s, dist)
    if not (online_tp and device.type == "cuda"):
        dist.init(device)  # (on GPUs transformers starts the group for the tensor-parallel target, below)
    rt = Runtime(
        ctx=ctx,
        plan_ctx=plan_ctx,
        dist=dist,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    vm = draft_vocab.load(vocab_dir)
    trc = plan.target.trust_remote_code
    draft: Eagle3Draft | DFlashDraft
    loss: TTTLoss | BlockLoss
    blocks: BlockLoss | None = None
    if s.draft == "dflash":
        draft, cols = build_dflash(model_id, aux, s, trc)
        head_d = head_full = torch.empty(0)  # the draft holds the target's head itself
        loss = blocks = BlockLoss.from_settings(s, rt.autocast, None if cols is None else cols.to(device))
    else:
        draft, head_d, head_full = build_draft(model_id, aux, vm, s, trc)
        loss = TTTLoss.from_settings(s, rt.autocast)
    draft.to(device)
    data = load_data(rt, s, man, ext_dir, model_id, aux, plan.target.max_length, trc, plan.target.engine)
    n = len(data.source)
    if s.batch_size % dist.world:
        raise ValueError(
            f"train.batch_size ({s.batch_size}) must be a multiple of the {dist.world} processes"
        )
    if n < s.batch_size:
        raise ValueError(f"only {n} training sequences but train.batch_size is {s.batch_size}")
    if ctx and s.eval_interval and not data.eval_rows:
        ctx.message(
            "no held-out rows in the extraction (extract.eval_rows = 0, bench.holdout = 0, or an extraction "
            "made before this version): acceptance is not tracked and draft/ is the last step",
            level="warning",
        )
    params = [p for p in draft.parameters() if p.requires_grad]
    td = TrainedDraft(
        draft=draft,
        model=draft,
        head_d=head_d.to(device),
        params=params,
        head_full=head_full.to(device) if loss.needs_full_head else None,
    )
    del head_full
    optim = Optimiser.adamw(params, s)
    checkpointer = Checkpointer(
        out=out,
        settings=s,
        extra={"world_size": dist.world, "aux_layer_ids": aux, "mode": data.mode},
        runtime=rt,
    )
    start = checkpointer.resume(td, optim)
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        td.model = DDP(
            draft, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    draft.train()
    if ctx:
        ctx.message(
            f"training {sum(p.numel() for p in params) / 1e6:.1f}M parameters on {n:,} sequences "
            f"({'online, target tensor-parallel over the ranks' if online_tp else data.mode} data), "
            f"{dist.world} process(es) on {device.type}, steps {start + 1}..{s.steps}, "
            + (
                f"DFlash: {s.dflash_layers} layer(s), blocks of {s.dflash_block_size}, {s.dflash_anchors} anchors per row"
                if blocks
                else f"TTT {s.ttt_steps}, loss {s.loss}{eagle31_note(s)}"
            )
        )
        ctx.progress(start, s.steps, unit="steps", force=True)
    last_saved = start
    source = data.source
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
        evaluator=Evaluator.from_settings(data, s, blocks),
        metrics=MetricReporter(ctx=ctx, log_every=s.log_every, last_step=s.steps, first_step=start + 1),
        schedule=schedule,
        feeder=feeder,
        micro_batch=s.micro_batch,
        steps_log=StepLog(out / STEPS_FILE, start) if dist.main else None,
        plateau=Plateau(s.stop_when_acceptance_flat, s.acceptance_min_delta),
    )
    best = checkpointer.best
    if best is not None:  # a resumed attempt counts from the best it kept
        steps.plateau.best, steps.plateau.best_step = best["accept_length"], best["step"]
    stopped: str | None = None
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
        feeder.close()
    best = checkpointer.best
    mode_name = data.mode
    if ctx and device.type == "cuda":
        ctx.metric("peak_memory_gib", torch.cuda.max_memory_allocated(device) / 2**30)
    if dist.main:
        final = out / FINAL_DIR
        tmp = out / (FINAL_DIR + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        if best is not None:
            shutil.copytree(out / BEST_DIR, tmp)
            (tmp / "best.json").unlink(missing_ok=True)
        else:
            save_any(draft, tmp)
        provenance.write(  # which target, tokenizer, data and recipe this draft is for: the serve stage checks it
            tmp,
            model=model_id,
            aux_layer_ids=aux,
            vocab_dir=vocab_dir,
            manifests={"extract": ext_dir / "manifest.json", "vocab": vocab_dir / "manifest.json"},
            sources=list(man.get("sources", [])),
            recipe={"draft": s.draft, "mode": mode_name, "world_size": dist.world, "train": asdict(s)},
            accept_length={
                "held_out": best["accept_length"] if best else None,
                "step": best["step"] if best else None,
                "spec_steps": s.spec_steps if best else None,
                "by_category": None,  # not measured per category in training; the bench stage's results.json
            },
        )
        swap_dir(tmp, final)
        write_json(
            out / "manifest.json",
            {
                "kind": "draft",
                "path": FINAL_DIR,
                "step": best["step"] if best else last_saved,
                "last_step": last_saved,
                "stopped_early": stopped,  # why training ended before [train] steps, or null
                "chosen_by": "simulated accept length on held-out rows" if best else "last step",
                "accept_length": best["accept_length"] if best else None,
                "eval_spec_steps": s.spec_steps if best else None,
                "target": model_id,
                "aux_layer_ids": aux,
                "steps_log": STEPS_FILE,
                "draft_vocab_size": vm.size,
                "draft": s.draft,
                "block_size": s.dflash_block_size if blocks else None,
                "ttt_steps": s.ttt_steps,
                "loss": "dflash" if blocks else s.loss,
                "fc_norm": s.draft_fc_norm,
                "norm_output": s.draft_norm_output,
                "mode": mode_name,
                "token_sources": list(man.get("sources", [])),
                "holdout": man.get("holdout"),
                "max_length": man.get("max_length"),
                "world_size": dist.world,
                "provenance": f"{FINAL_DIR}/{provenance.PROVENANCE_FILE}",
            },
        )
        if ctx:
            end = last_saved if stopped else s.steps
            ctx.progress(end, end, unit="steps", force=True)
            which = (
                f"the step-{best['step']} checkpoint, best simulated accept length {best['accept_length']:.3f}"
                if best
                else f"step {last_saved}"
            )
            serve = (
                f"--speculative-algorithm DFLASH --speculative-num-draft-tokens {s.dflash_block_size}"
                if blocks
                else "--speculative-algorithm EAGLE3"
            )
            ctx.message(
                f"draft written to {final} ({which}; SGLang: {serve} --speculative-draft-model-path {final})"
            )
    return 0
