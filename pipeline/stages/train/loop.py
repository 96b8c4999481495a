"""The training stage's program: find the inputs, build the draft, resume, and run the steps (see :mod:`pipeline.stages.train`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import pipeline.stages.train as train_pkg
from pipeline.data.shards import find_manifests
from pipeline.eagle3 import draft_vocab
from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.draft_model import DraftConfig, Eagle3Draft, save_draft
from pipeline.run.files import swap_dir
from pipeline.run.plan_sections import TrainSection
from pipeline.run.ranks import Dist, die_with_parent, reexec_under_torchrun
from pipeline.run.rundir import write_json
from pipeline.run.runtime import StageContext, add_common_args, fail
from pipeline.stages.train.batches import OfflineData, OnlineData
from pipeline.stages.train.checkpoints import (
    BEST_DIR,
    FINAL_DIR,
    STATE_FILE,
    STEPS_FILE,
    StepLog,
    checkpoints,
    read_best,
)
from pipeline.stages.train.feeder import Feeder, Inline
from pipeline.stages.train.settings import BatchSchedule
from pipeline.stages.train.steps import Steps, rank_chunks


def find_inputs(dirs: list[Path]) -> tuple[dict, Path, Path]:
    """(extraction manifest, its dir, vocab dir) among the input dirs, by manifest kind."""
    ext = vocab = None
    for d in dirs:
        for mpath, man in find_manifests(d):
            if man.get("kind") == hs.KIND:
                ext = (man, mpath.parent)
            elif man.get("kind") == draft_vocab.MANIFEST_KIND:
                vocab = mpath.parent
    if ext is None:
        raise ValueError(
            f"no extraction among the inputs ({', '.join(map(str, dirs))}): put the extract stage in 'after'"
        )
    if vocab is None:
        raise ValueError(
            f"no draft vocabulary among the inputs ({', '.join(map(str, dirs))}): put the vocab stage in 'after'"
        )
    return ext[0], ext[1], vocab


def pick_device(s: TrainSection, dist: Dist) -> torch.device:
    if s.device:
        dev = torch.device(s.device)
    else:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(dev)
    return dev


def build_draft(
    model_id: str, aux: list[int], vm: draft_vocab.VocabMap, s: TrainSection
) -> tuple[Eagle3Draft, torch.Tensor]:
    from pipeline.eagle3.target_capture import load_target_tensors, target_config

    tcfg = target_config(model_id)
    cfg = DraftConfig.from_target(tcfg, vm.size, aux)
    torch.manual_seed(s.seed)
    draft = Eagle3Draft(cfg)
    t = load_target_tensors(model_id)
    draft.embed_tokens.weight.data.copy_(t["embed"])
    draft.set_vocab(vm.d2t, vm.t2d)
    head_d = t["head"][vm.draft_ids].clone()
    if s.init_lm_head == "target":
        draft.lm_head.weight.data.copy_(head_d)
        draft.norm.weight.data.copy_(t["norm"])
    return draft, head_d


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
    mode = plan_ctx.plan.settings.storage_mode
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
        return train(ctx, plan_ctx, s, mode, inputs, dist)
    except (ValueError, hs.StoreError, draft_vocab.VocabError) as exc:
        fail(ctx, str(exc))
    finally:
        dist.close()
    return 1


def train(
    ctx: StageContext | None,
    plan_ctx: StageContext,
    s: TrainSection,
    mode: str,
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
    autocast = device.type == "cuda"
    dtype = torch.bfloat16 if autocast else torch.float32
    vm = draft_vocab.load(vocab_dir)
    draft, head_d = build_draft(model_id, aux, vm, s)
    draft.to(device)
    head_d = head_d.to(device)
    eval_data: Any = None
    if man["mode"] == "offline":
        data: Any = OfflineData(hs.HiddenStore(ext_dir))
        if s.eval_interval and man.get("eval_shards"):
            eval_data = OfflineData(hs.HiddenStore(ext_dir, split="eval"))
    else:
        from pipeline.data.shards import iter_rows, training_order
        from pipeline.eagle3.target_capture import load_target

        max_len = man.get("max_length") or s.max_length or plan.target.max_length
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
        if online_tp:
            target = load_target(model_id, aux, dtype=dtype, device=device, parallel="tp")
            dist.init(device)  # a no-op where transformers started the group
        else:
            target = load_target(model_id, aux, dtype=dtype, device=device)
        data = OnlineData(rows, target)
        if s.eval_interval and float(man.get("holdout") or 0) > 0:
            held = training_order(
                list(
                    iter_rows(
                        [Path(p) for p in man["sources"]], float(man["holdout"]), "heldout", None, max_len
                    )
                )
            )
            held = [r for r in held if r.num_tokens >= 2 and r.loss_mask.any()][: s.eval_rows]
            eval_data = OnlineData(held, target) if held else None
    n = len(data)
    if s.batch_size % dist.world:
        raise ValueError(
            f"train.batch_size ({s.batch_size}) must be a multiple of the {dist.world} processes"
        )
    if n < s.batch_size:
        raise ValueError(f"only {n} training sequences but train.batch_size is {s.batch_size}")
    eval_rows = list(range(min(s.eval_rows, len(eval_data)))) if eval_data is not None else []
    if ctx and s.eval_interval and not eval_rows:
        ctx.message(
            "no held-out rows in the extraction (extract.eval_rows = 0, bench.holdout = 0, or an extraction "
            "made before this version): acceptance is not tracked and draft/ is the last step",
            level="warning",
        )
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    start = 0
    found = checkpoints(out)
    if found:
        step0, path = found[-1]
        st = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        draft.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["optimizer"])
        start = int(st["step"])
        if ctx:
            ctx.message(
                f"resuming from checkpoint {path.name} (step {start})",
                code="resumed_from_checkpoint",
                step=start,
            )
    best = read_best(out)
    if best is not None and best["step"] > start:
        best = None  # chosen in an attempt whose steps after the checkpoint were lost: not this lineage
    model: Any = draft
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            draft, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    draft.train()
    if ctx:
        ctx.message(
            f"training {sum(p.numel() for p in params) / 1e6:.1f}M parameters on {n:,} sequences "
            f"({'online, target tensor-parallel over the ranks' if online_tp else man['mode']} data), "
            f"{dist.world} process(es) on {device.type}, steps {start + 1}..{s.steps}, "
            f"TTT {s.ttt_steps}"
        )
        ctx.progress(start, s.steps, unit="steps", force=True)
    mode_name = "online-tp" if online_tp else man["mode"]
    extra = {"world_size": dist.world, "aux_layer_ids": aux, "mode": mode_name}
    steps_log = StepLog(out / STEPS_FILE, start) if dist.main else None
    last_saved = start
    schedule = BatchSchedule(
        n,
        s.batch_size,
        s.seed,
        [data.length(i) for i in range(n)] if s.length_grouping else None,
        s.length_grouping,
    )

    def my_chunks(step: int) -> list[list[int]]:
        return rank_chunks(schedule.rows(step), dist.rank, dist.world, data.length, s.micro_batch)

    feeder: Any = (
        Feeder(data, range(start + 1, s.steps + 1), my_chunks, device, dtype, s.prefetch)
        if isinstance(data, OfflineData) and s.prefetch and device.type == "cuda"
        else Inline(data, my_chunks, device, dtype)
    )
    steps = Steps(
        ctx,
        plan_ctx,
        s,
        dist,
        device,
        dtype,
        data,
        online_tp,
        model,
        draft,
        opt,
        params,
        head_d,
        autocast,
        steps_log,
        out,
        extra,
        schedule,
        feeder,
        eval_data,
        eval_rows,
        best,
        start + 1,
    )
    if start and steps.eval_due(start) and (best is None or best["step"] < start):
        steps.evaluate(start, saved=True)  # killed between that checkpoint and its evaluation
    try:
        for step in range(start + 1, s.steps + 1):
            steps.run(step)
            if step % s.checkpoint_every == 0 or step == s.steps:
                steps.checkpoint(step)
                last_saved = step
            if steps.eval_due(step):
                steps.evaluate(step, saved=last_saved == step)
    finally:
        feeder.close()
    best = steps.best
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
            save_draft(draft, tmp)
        swap_dir(tmp, final)
        write_json(
            out / "manifest.json",
            {
                "kind": "draft",
                "path": FINAL_DIR,
                "step": best["step"] if best else last_saved,
                "last_step": last_saved,
                "chosen_by": "simulated accept length on held-out rows" if best else "last step",
                "accept_length": best["accept_length"] if best else None,
                "eval_spec_steps": s.spec_steps if best else None,
                "target": model_id,
                "aux_layer_ids": aux,
                "steps_log": STEPS_FILE,
                "draft_vocab_size": vm.size,
                "ttt_steps": s.ttt_steps,
                "mode": mode_name,
                "token_sources": list(man.get("sources", [])),
                "holdout": man.get("holdout"),
                "max_length": man.get("max_length"),
                "world_size": dist.world,
            },
        )
        if ctx:
            ctx.progress(s.steps, s.steps, unit="steps", force=True)
            which = (
                f"the step-{best['step']} checkpoint, best simulated accept length {best['accept_length']:.3f}"
                if best
                else f"step {last_saved}"
            )
            ctx.message(
                f"draft written to {final} ({which}; SGLang: --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {final})"
            )
    return 0
