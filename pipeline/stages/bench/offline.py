"""Offline acceptance: greedy speculative decoding of the target with the trained draft on held-out prompts.

The target is on one device, spread over several (``device = "auto"``: the draft then runs where the
target's last hidden state comes out), or tensor-parallel over the ranks of a torchrun (``parallel = "tp"``:
rank 0 drafts and broadcasts its tokens, so every rank verifies the same ones). The draft method the train
manifest names (:func:`pipeline.drafts.registry.draft_method`) loads the drafter and says what it refuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.drafts.registry import DrafterInputs, draft_method
from pipeline.eagle3.spec_decode import Drafter, RankZeroDrafter
from pipeline.manifests import bench as bench_manifest
from pipeline.manifests.bench import BenchManifest
from pipeline.manifests.train import DraftManifest
from pipeline.run.rundir.layout import write_json
from pipeline.run.stage_side.ranks import Dist, tp_device
from pipeline.run.stage_side.runtime import StageContext, fail
from pipeline.stages.bench.gap import gap_record, report_gap
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
    sec = ctx.plan.settings.bench
    man, train_dir = find_draft(inputs)
    method = draft_method(man.method_name)  # the train manifest says which method trained it
    steps = sec.steps
    problem = method.bench_problem(man.to_dict(), steps, dist is not None)  # the method reads its own keys
    if problem:
        fail(ctx, problem)
    model_id = str(ctx.plan.target.model or man.target)
    target, dev, dtype = load_bench_target(ctx, model_id, list(man.aux_layer_ids), dist)
    prompts = heldout_prompts(man, sec.prompt_count(online=False), int(target.embed_weight.shape[0]))
    if not prompts:
        fail(ctx, "no held-out prompts: every row was used for training; raise [bench] holdout")
    embed = target.embed_weight.detach().float()  # under TP a collective: every rank gathers it
    drafter: Drafter | None = None
    if dist is None or dist.main:
        path = man.draft_path(train_dir)
        drafter = method.drafter(DrafterInputs(path, target, list(man.aux_layer_ids), dev, dtype, embed))
    if dist is not None:  # rank 0 drafts; the others verify its tokens (never drafts of their own)
        drafter = RankZeroDrafter(drafter, dist.rank, dev)
    assert drafter is not None
    eos = eos_ids(model_id, target, ctx.plan.target.trust_remote_code)
    max_new = sec.new_tokens(online=False)
    ctx.message(
        f"speculative decoding of {len(prompts)} held-out prompts, {steps} draft tokens per verify step, "
        f"up to {max_new} new tokens"
    )
    t0 = time.monotonic()
    run = decode_prompts(ctx, target, drafter, prompts, steps, max_new, eos, dtype, sec.check_lossless, dist)
    elapsed = time.monotonic() - t0
    if dist is not None and not dist.main:
        return 0
    write_results(ctx, run, steps, elapsed, (man, train_dir), sec.check_lossless)
    return 0


def load_bench_target(
    ctx: StageContext, model_id: str, aux: list[int], dist: Dist | None
) -> tuple[Any, torch.device, torch.dtype]:
    """(the target, where the draft runs, the dtype): tensor-parallel over the ranks with ``dist``, else on
    ``[bench] device`` (``"auto"``: spread over the GPUs, the draft where the features come out)."""
    from pipeline.eagle3.target_capture import load_target

    sec, trc = ctx.plan.settings.bench, ctx.plan.target.trust_remote_code
    if dist is not None:
        dev = tp_device(dist, sec.device)
        if dev.type == "cpu":
            dist.init(dev)  # gloo: transformers would pick the accelerator's backend where there is one
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        target = load_target(model_id, aux, dtype=dtype, device=dev, parallel="tp", trust_remote_code=trc)
        dist.init(dev)  # a no-op: transformers started the group (NCCL, bound to this rank's GPU)
        ctx.message(f"target loaded tensor-parallel over {dist.world} ranks ({dev.type})")
        return target, dev, dtype
    name = sec.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.cuda.is_available() if name == "auto" else torch.device(name).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # "auto": accelerate spreads the layers over the GPUs; the draft goes where the features come out
    target = load_target(model_id, aux, dtype=dtype, device=name, trust_remote_code=trc)
    return target, draft_device(target), dtype


@dataclass
class DecodeRun:
    """What the prompts' decodes gave: each prompt's line, every verify step's accepted drafts, the tokens
    generated and how many bf16 near-ties made the output differ from greedy decoding."""

    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    gen_tokens: int = 0
    mismatches: int = 0


def decode_prompts(
    ctx: StageContext,
    target: Any,
    drafter: Drafter,
    prompts: list[tuple[str, list[int]]],
    steps: int,
    max_new: int,
    eos: set[int],
    dtype: torch.dtype,
    check: bool,
    dist: Dist | None,
) -> DecodeRun:
    """Each prompt decoded speculatively (and greedily too with ``check``: the output must be the same)."""
    from pipeline.eagle3.spec_decode import speculative_generate

    run = DecodeRun()
    for i, (rid, prompt) in enumerate(prompts):
        if dist is not None:
            dist.safe_point(ctx, target.device)
        else:
            ctx.safe_point()
        res = speculative_generate(target, drafter, prompt, steps, max_new, eos)
        if check and not matches_greedy(ctx, target, rid, prompt, res.tokens, max_new, eos, dtype):
            run.mismatches += 1
        run.accepted.extend(res.accepted)
        run.gen_tokens += len(res.tokens)
        run.per_prompt.append(
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
    return run


def matches_greedy(
    ctx: StageContext,
    target: Any,
    rid: str,
    prompt: list[int],
    tokens: list[int],
    max_new: int,
    eos: set[int],
    dtype: torch.dtype,
) -> bool:
    """Whether the speculative output is the target's greedy decode; a difference fails the stage in fp32 (a
    bug) and is a warning in bf16 (kernels of different shapes can flip a near-tie of the argmax)."""
    from pipeline.eagle3.spec_decode import greedy_generate

    ref = greedy_generate(target, prompt, max_new, eos)
    if ref == tokens:
        return True
    where = next(p for p, (a, b) in enumerate(zip([*ref, -1], [*tokens, -1], strict=False)) if a != b)
    text = (
        f"prompt {rid}: speculative output differs from greedy decoding from token {where} on: "
        f"{tokens[where : where + 8]} vs {ref[where : where + 8]}"
    )
    if dtype == torch.float32:
        fail(ctx, text + " (a bug: in fp32 they are identical)")
    ctx.message(text + " (bf16 near-tie)", level="warning")
    return False


def write_results(
    ctx: StageContext,
    run: DecodeRun,
    steps: int,
    elapsed: float,
    draft: tuple[DraftManifest, Path],
    check: bool,
) -> None:
    """``results.json`` (with every prompt's line), ``manifest.json`` (the summary) and the metrics."""
    accepted = run.accepted
    if not accepted:
        fail(ctx, "no verify step ran (every prompt ended at its first token)")
    accept_len = sum(accepted) / len(accepted) + 1
    accept_rate = sum(accepted) / (steps * len(accepted))
    hist = [accepted.count(n) for n in range(steps + 1)]
    man, train_dir = draft
    gap = gap_record(
        man,
        train_dir,
        accept_len,
        f"{ctx.out / 'results.json'}: accept_len over {len(accepted)} verify steps of "
        f"{len(run.per_prompt)} held-out prompts (per_prompt)",
        how="measured",  # speculative decoding here, not an engine's
    )
    summary = BenchManifest(
        kind=bench_manifest.KIND,
        mode="offline",
        accept_len=accept_len,
        accept_rate=accept_rate,
        max_accept_len=steps + 1,
        steps=steps,
        prompts=len(run.per_prompt),
        verify_steps=len(accepted),
        new_tokens=run.gen_tokens,
        accepted_histogram=tuple(hist),
        elapsed_s=elapsed,
        draft=str(man.draft_path(train_dir)),
        draft_kind=man.method_name,
        lossless_checked=check,
        lossless_mismatches=run.mismatches if check else None,
        accept_gap=gap,
    )
    write_json(ctx.out / "results.json", {**summary.to_dict(), "per_prompt": run.per_prompt})
    bench_manifest.write(ctx.out / "manifest.json", summary)
    ctx.metric("accept_rate", accept_rate)
    ctx.metric("verify_steps", len(accepted))
    ctx.metric("accept_len", accept_len, max=steps + 1)
    report_gap(ctx, gap)
    ctx.message(
        f"accept length {accept_len:.2f} of at most {steps + 1} ({accept_rate:.1%} of draft tokens accepted) "
        f"over {len(accepted)} verify steps; histogram of accepted drafts 0..{steps}: {hist}"
    )
