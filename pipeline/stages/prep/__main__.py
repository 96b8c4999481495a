"""``python -m pipeline.stages.prep --plan PLAN --dataset NAME [--check N]``: prepare one dataset of a plan.

Without ``--check`` this is the stage: it validates the first ``[prep] check_rows`` rows, then writes
shards and a manifest into the stage's out dir (``--out DIR`` when run by hand), resumably. With
``--check N`` it only reads and validates the first N rows of NAME (of every dataset when NAME is left
out), prints each malformed row with its dataset, row index and field, writes nothing and exits 1 if any
row is malformed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.data import sources
from pipeline.run.plan import dag as plan_mod
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.stages.prep.rows import TARGET_NATIVE
from pipeline.stages.prep.settings import PrepSettings


def _tokenizer(plan: plan_mod.Plan, settings: PrepSettings) -> Any:  # a ChatTokenizer, imported lazily
    # The fast tokenizer's thread pool is sized when it is first imported: keep it to the cpu slots we hold.
    os.environ.setdefault("RAYON_NUM_THREADS", str(settings.tokenizer_threads))
    from pipeline.data.tokenise import load_chat_tokenizer

    model = plan.target.model
    if not model:
        raise plan_mod.PlanError(
            plan.path, "target.model", "target-native datasets need the target model's tokenizer"
        )
    return load_chat_tokenizer(
        model,
        settings.max_length,
        settings.template_kwargs,
        trust_remote_code=plan.target.trust_remote_code,
    )


def _check(plan: plan_mod.Plan, names: list[str], n: int) -> int:
    from pipeline.stages.prep.check import check_dataset

    tok = None
    bad = 0
    with tempfile.TemporaryDirectory(prefix="aerie-prep-check-") as cache:
        for name in names:
            ds = plan.dataset(name)
            settings = PrepSettings.from_plan(plan, ds)
            if ds.kind == TARGET_NATIVE and tok is None:
                tok = _tokenizer(plan, settings)
            rep = check_dataset(
                ds, tok if ds.kind == TARGET_NATIVE else None, n, Path(cache), settings.batch_rows
            )
            print(rep.summary())
            for line in rep.lines(limit=len(rep.problems)):
                print("  " + line)
            bad += len(rep.problems)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    # Prep needs no torch; without this `datasets` imports it for every streamed dataset (seconds per process).
    os.environ.setdefault("USE_TORCH", "0")
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.prep", description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--dataset", help="dataset name from the plan's [[datasets]]")
    ap.add_argument("--check", type=int, metavar="N", help="only validate the first N rows; write nothing")
    args = ap.parse_args(argv)
    if args.plan is None:
        ap.error("--plan is required")
    try:
        plan = plan_mod.load(args.plan, run_dir=os.environ.get("AERIE_RUN_DIR"))
        if args.check is not None:
            if args.check < 1:
                ap.error("--check needs a positive number of rows")
            names = [args.dataset] if args.dataset else [d.name for d in plan.datasets]
            return _check(plan, names, args.check)
        if not args.dataset:
            ap.error("--dataset is required")
        ds = plan.dataset(args.dataset)
        sources.get(ds.source)
        settings = PrepSettings.from_plan(plan, ds)
    except (plan_mod.PlanError, KeyError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    from pipeline.stages.prep.run import PrepRun

    ctx = StageContext.from_cli(args)
    try:
        tok = _tokenizer(plan, settings) if ds.kind == TARGET_NATIVE else None
        return PrepRun(ctx, ds, settings, tok).run()
    except (FileNotFoundError, ValueError, plan_mod.PlanError) as exc:
        fail(ctx, f"{ds.name}: {exc}")
        return 1
    finally:
        ctx.close()


if __name__ == "__main__":
    raise SystemExit(main())
