"""Bench stage: does the draft work? Offline acceptance, or the online SGLang deploy benchmark.

``python -m pipeline.stages.bench --plan PLAN [--mode offline|online] [--input DIR ...] [--out DIR]``

**offline** (default, runs anywhere): greedy speculative decoding of the target with the trained
draft (the ``draft`` manifest of the train stage among the inputs) on held-out prompts (the rows
of ``[bench] holdout`` that extraction and training never saw), ``[bench] steps`` draft tokens per
verify step (SGLang's ``--speculative-num-steps``, topk 1). Reports ``accept_len`` (mean tokens per
verify step, accepted + the target's own, at most ``steps + 1``) and ``accept_rate`` (share of draft
tokens accepted) — shown on the board — and writes ``results.json``. ``[bench] check_lossless``
also decodes plainly and fails if the outputs differ (they never should).

**online** (``engine = "sglang"``, GPU only): see ``pipeline.stages.bench.online``; ``--label`` names the run
(``plain`` / ``eagle3``), the endpoint comes from the serve stage the bench stage ``uses``, each of ``[bench]
batches`` closed-loop streams is measured in turn, and ``--baseline STAGE`` compares against an earlier online
bench (the speedup at each batch).

Plan keys (``[bench]``, all listed by ``aerie plan check --show-defaults``): ``engine`` / ``mode``, ``holdout``,
``prompts``, ``max_new_tokens``, ``steps``, ``check_lossless``, ``device``; online: ``batches``,
``requests_per_stream``, ``concurrency``, ``timeout_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.data.shards import ShardError
from pipeline.run.stage_side.ranks import Dist, tensor_parallel_rank
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.stages.bench.offline import run_offline

MODES = ("offline", "online")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.bench", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--mode", choices=MODES, default=None, help="default: [bench] mode, else offline")
    ap.add_argument(
        "--input", action="append", default=[], help="an upstream out dir (default: the stage's inputs)"
    )
    ap.add_argument("--label", default=None, help="online: the name of this run (plain, eagle3)")
    ap.add_argument("--baseline", default=None, help="online: an earlier online bench stage to compare with")
    ap.add_argument(
        "--url", default=None, help="online: the server's base URL (default: the used serve stage's)"
    )
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    mode = args.mode or ("online" if ctx.plan.settings.bench.online else "offline")
    inputs = [Path(p) for p in args.input] if args.input else [ctx.inputs[k] for k in sorted(ctx.inputs)]
    dist = Dist()
    try:
        if mode == "offline":
            tp = tensor_parallel_rank(ctx, "bench", "pipeline.stages.bench", argv)
            return run_offline(ctx, inputs, dist if tp else None)
        from pipeline.stages.bench.online import run_online

        return run_online(ctx, inputs, args)
    except (ValueError, ShardError, json.JSONDecodeError) as exc:
        fail(ctx, str(exc))
    finally:
        dist.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
