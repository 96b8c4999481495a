"""Vocab stage: the draft vocabulary (top-K assistant tokens) and its d2t / t2d maps.

``python -m pipeline.stages.vocab --plan PLAN [--input DIR ...] [--out DIR]``

Counts ``input_ids[loss_mask == 1]`` over the training rows of every tokenized input (the held-out
rows of ``[bench] holdout`` excluded, as in extraction), keeps ``[vocab] draft_vocab_size`` tokens
(default 32000, capped at the target vocabulary) and writes ``vocab.safetensors`` + ``manifest.json``
(see ``pipeline.eagle3.draft_vocab``). Reports ``vocab_coverage``: the share of counted target tokens that
the draft vocabulary covers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from pipeline.data.shards import ShardError, holdout_fraction, iter_rows
from pipeline.eagle3 import draft_vocab
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail


def count_tokens(
    inputs: list[Path],
    holdout: float,
    vocab_size: int,
    max_length: int | None,
    ctx: StageContext | None = None,
) -> tuple[np.ndarray, int]:
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = 0
    for row in iter_rows(inputs, holdout, "train", vocab_size, max_length):
        sel = row.input_ids[row.loss_mask == 1]
        counts += np.bincount(sel, minlength=vocab_size)
        rows += 1
        if ctx is not None and rows % 256 == 0:
            ctx.safe_point()
            ctx.progress(rows, None, unit="rows")
    return counts, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.vocab", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument(
        "--input", action="append", default=[], help="an upstream out dir (default: the stage's inputs)"
    )
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    from pipeline.eagle3.target_capture import target_config

    plan = ctx.plan
    inputs = [Path(p) for p in args.input] if args.input else [ctx.inputs[k] for k in sorted(ctx.inputs)]
    if not inputs:
        fail(ctx, "no inputs: the vocab stage needs the out dirs of the prep/regen stages")
    try:
        vocab_size = int(
            target_config(str(plan.target.model), trust_remote_code=plan.target.trust_remote_code).vocab_size
        )
        size = plan.settings.vocab.draft_vocab_size
        if size > vocab_size:
            ctx.message(
                f"draft_vocab_size {size} exceeds the target vocabulary; using {vocab_size}", level="warning"
            )
            size = vocab_size
        counts, rows = count_tokens(inputs, holdout_fraction(plan), vocab_size, plan.target.max_length, ctx)
    except (ShardError, draft_vocab.VocabError) as exc:
        fail(ctx, str(exc))
    total = int(counts.sum())
    if total == 0:
        fail(ctx, f"no assistant tokens in {rows} training rows: cannot build a draft vocabulary")
    vm = draft_vocab.build(counts, size)
    cov = vm.coverage()
    draft_vocab.save(
        vm,
        ctx.out,
        extra={
            "rows": rows,
            "tokens": total,
            "distinct_tokens": int((counts > 0).sum()),
            "target": plan.target.model,
        },
    )
    ctx.progress(rows, rows, unit="rows", force=True)
    ctx.metric("vocab_coverage", cov, draft_vocab_size=size)
    ctx.message(
        f"draft vocabulary: {size:,} of {vocab_size:,} ids cover {cov:.2%} of {total:,} assistant tokens "
        f"({int((counts > 0).sum()):,} distinct)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
