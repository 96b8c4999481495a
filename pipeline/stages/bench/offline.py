"""Offline acceptance: greedy speculative decoding of the target with the trained draft on held-out prompts.

The target is on one device, spread over several (``device = "auto"``: the draft then runs where the
target's last hidden state comes out), or tensor-parallel over the ranks of a torchrun (``parallel = "tp"``:
rank 0 drafts and broadcasts its tokens, so every rank verifies the same ones).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pipeline.run.ranks import Dist, tp_device
from pipeline.run.rundir import write_json
from pipeline.run.runtime import StageContext, fail
from pipeline.stages.bench.inputs import find_draft, heldout_prompts


def eos_ids(model_id: str, target: Any, trust_remote_code: bool = False) -> set[int]:
    """The ids that end the target's answer (:mod:`pipeline.data.token_facts`: chat template + generation config)."""
    from pipeline.data import token_facts
    from pipeline.data.model_assets import turn_tokens

    try:
        facts = turn_tokens(model_id, trust_remote_code=trust_remote_code)
    except (
        OSError,
        ValueError,
    ):  # a weights-only folder (no tokenizer files): the loaded model's generation config
        gen = getattr(target.model, "generation_config", None)
        ids = token_facts.id_list(getattr(gen, "eos_token_id", None))
        if not ids:
            raise
        return set(ids)
    return facts.stop_ids


def draft_device(target: Any) -> torch.device:
    """Where the draft runs: beside the target's final hidden state, where :meth:`Target.capture` gathers the
    aux features (the last layers' device when ``device = "auto"`` spreads the target over several)."""
    return target.base.norm.weight.device


def run_offline(ctx: StageContext, inputs: list[Path], dist: Dist | None = None) -> int:
    """Speculative decoding on held-out prompts; with ``dist`` every rank holds a tensor-parallel
    shard of the target and runs the same decode (same tokens on every rank), rank 0 writes."""
    from pipeline.eagle3.dflash_decode import dflash_drafter
    from pipeline.eagle3.draft_model import load_draft
    from pipeline.eagle3.spec_decode import (
        Drafter,
        Eagle3Drafter,
        RankZeroDrafter,
        greedy_generate,
        speculative_generate,
    )
    from pipeline.eagle3.target_capture import load_target

    plan = ctx.plan
    sec = plan.settings.bench
    man, train_dir = find_draft(inputs)
    if man.get("draft") == "dflash" and dist is not None:
        fail(
            ctx,
            'the offline bench of a DFlash draft runs the target on one device or spread (device = "auto"), not tensor-parallel',
        )
    model_id = str(plan.target.model or man.get("target"))
    trc = plan.target.trust_remote_code
    steps = sec.steps
    max_new = sec.new_tokens(online=False)
    n_prompts = sec.prompt_count(online=False)
    if dist is not None:
        dev = tp_device(dist, sec.device)
        if dev.type == "cpu":
            dist.init(dev)  # gloo: transformers would pick the accelerator's backend where there is one
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        target = load_target(
            model_id,
            list(man["aux_layer_ids"]),
            dtype=dtype,
            device=dev,
            parallel="tp",
            trust_remote_code=trc,
        )
        dist.init(dev)  # a no-op: transformers started the group (NCCL, bound to this rank's GPU)
        ctx.message(f"target loaded tensor-parallel over {dist.world} ranks ({dev.type})")
    else:
        name = sec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = torch.cuda.is_available() if name == "auto" else torch.device(name).type == "cuda"
        dtype = torch.bfloat16 if on_gpu else torch.float32
        # "auto": accelerate spreads the layers over the GPUs; the draft goes where the features come out
        target = load_target(
            model_id, list(man["aux_layer_ids"]), dtype=dtype, device=name, trust_remote_code=trc
        )
        dev = draft_device(target)
    vocab = int(target.embed_weight.shape[0])
    prompts = heldout_prompts(man, n_prompts, vocab)
    if not prompts:
        fail(ctx, "no held-out prompts: every row was used for training; raise [bench] holdout")
    embed = target.embed_weight.detach().float()  # under TP a collective: every rank gathers it
    drafter: Drafter | None = None
    if man.get("draft") == "dflash" and (dist is None or dist.main):
        drafter = dflash_drafter(
            train_dir / man.get("path", "draft"), target, list(man["aux_layer_ids"]), dev, dtype
        )
        block = int(man.get("block_size") or 0)
        if steps > block - 1:
            fail(
                ctx,
                f"[bench] steps is {steps} but the DFlash draft's blocks of {block} draft {block - 1}: set it to {block - 1}",
            )
    elif dist is None or dist.main:
        draft = load_draft(train_dir / man.get("path", "draft"), embed=embed, dtype=dtype).to(dev)
        drafter = Eagle3Drafter(draft)
    if dist is not None:  # rank 0 drafts; the others verify its tokens (never drafts of their own)
        drafter = RankZeroDrafter(drafter, dist.rank, dev)
    assert drafter is not None
    eos = eos_ids(model_id, target, trc)
    check = sec.check_lossless
    ctx.message(
        f"speculative decoding of {len(prompts)} held-out prompts, {steps} draft tokens per verify step, "
        f"up to {max_new} new tokens"
    )
    per_prompt = []
    accepted: list[int] = []
    t0 = time.monotonic()
    gen_tokens = 0
    mismatches = 0
    for i, (rid, prompt) in enumerate(prompts):
        if dist is not None:
            dist.safe_point(ctx, target.device)
        else:
            ctx.safe_point()
        res = speculative_generate(target, drafter, prompt, steps, max_new, eos)
        if check:
            ref = greedy_generate(target, prompt, max_new, eos)
            if ref != res.tokens:
                where = next(
                    p for p, (a, b) in enumerate(zip([*ref, -1], [*res.tokens, -1], strict=False)) if a != b
                )
                text = (
                    f"prompt {rid}: speculative output differs from greedy decoding from token {where} on: "
                    f"{res.tokens[where : where + 8]} vs {ref[where : where + 8]}"
                )
                if dtype == torch.float32:
                    fail(ctx, text + " (a bug: in fp32 they are identical)")
                # bf16 kernels of different shapes (k+1 tokens vs 1) can flip a near-tie of the argmax
                mismatches += 1
                ctx.message(text + " (bf16 near-tie)", level="warning")
        accepted.extend(res.accepted)
        gen_tokens += len(res.tokens)
        per_prompt.append(
            {
                "id": rid,
                "prompt_tokens": len(prompt),
                "new_tokens": len(res.tokens),
                "verify_steps": res.steps,
                "accept_len": res.accept_len,
                "accepted": res.accepted,
            }
        )
        ctx.progress(i + 1, len(prompts), unit="prompts")
    elapsed = time.monotonic() - t0
    if dist is not None and not dist.main:
        return 0
    if not accepted:
        fail(ctx, "no verify step ran (every prompt ended at its first token)")
    accept_len = sum(accepted) / len(accepted) + 1
    accept_rate = sum(accepted) / (steps * len(accepted))
    hist = [accepted.count(n) for n in range(steps + 1)]
    summary = {
        "kind": "bench",
        "mode": "offline",
        "accept_len": accept_len,
        "accept_rate": accept_rate,
        "max_accept_len": steps + 1,
        "steps": steps,
        "prompts": len(prompts),
        "verify_steps": len(accepted),
        "new_tokens": gen_tokens,
        "accepted_histogram": hist,
        "elapsed_s": elapsed,
        "draft": str(train_dir / man.get("path", "draft")),
        "draft_kind": man.get("draft", "eagle3"),
        "lossless_checked": check,
        "lossless_mismatches": mismatches if check else None,
    }
    write_json(ctx.out / "results.json", {**summary, "per_prompt": per_prompt})
    write_json(ctx.out / "manifest.json", summary)
    ctx.metric("accept_rate", accept_rate)
    ctx.metric("verify_steps", len(accepted))
    ctx.metric("accept_len", accept_len, max=steps + 1)
    ctx.message(
        f"accept length {accept_len:.2f} of at most {steps + 1} ({accept_rate:.1%} of draft tokens accepted) "
        f"over {len(accepted)} verify steps; histogram of accepted drafts 0..{steps}: {hist}"
    )
    return 0
