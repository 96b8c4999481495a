"""How the methods harness calls Aerie's real stages: the one plan (a recipe's ``[train]`` keys and a spec's
``[bench] steps`` over shared sections), each stage by its command line with ``datasets`` on its path, and
the manifest through which the bench stage reads a draft (the train stage's or an external trainer's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.methods_gen import MODEL, log
from bench.gpu.runner import ROOT

EXTRA = Path(
    "/tmp/sgl/extra"
)  # `datasets` for the stages, unpacked from .gpu-stage/c2 by bench.gpu.staging.stage


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(v)


def plan_text(
    args: argparse.Namespace, work: Path, train: dict[str, Any], bench_steps: int, quota: dict[str, int]
) -> str:
    """One plan for every stage; only ``[train]`` (the recipe) and ``[bench] steps`` (the spec) change."""
    keys = {
        "steps": args.steps,
        "batch_size": args.batch,
        "micro_batch": args.batch,
        "ttt_steps": args.ttt,
        "lr": args.lr,
        "checkpoint_every": args.checkpoint_every,
        "keep_checkpoints": 2,
        "log_every": 20,
        "eval_spec_steps": min(3, args.ttt),
        **train,
    }
    train_lines = "\n".join(f"{k} = {toml_value(v)}" for k, v in keys.items())
    datasets = "".join(
        f'[[datasets]]\nname = "{name}"\nsource = "ultrachat"\nkind = "target-native"\npath = "{work / (name + ".jsonl")}"\nquota = {n}\n'
        for name, n in quota.items()
    )
    return f"""[run]
name = "methods"
dir = "{work / "run"}"
[target]
model = "{MODEL}"
max_length = 1024
[prep]
reject_threshold = 0.5
[extract]
batch_tokens = 65536
shard_tokens = 1048576
eval_rows = 64
max_tokens = {args.max_tokens}
[vocab]
draft_vocab_size = {args.draft_vocab}
[train]
{train_lines}
[bench]
holdout = {args.holdout}
prompts = {args.bench_prompts}
max_new_tokens = {args.bench_tokens}
steps = {bench_steps}
check_lossless = {toml_value(args.check_lossless)}
{datasets}"""


def stage(module: str, plan: Path, out: Path, inputs: list[Path], *extra: str) -> float:
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out), *extra]
    for i in inputs:
        argv += ["--input", str(i)]
    return run_logged(argv, module)


def run_logged(argv: list[str], what: str) -> float:
    env = dict(os.environ)
    if EXTRA.is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(EXTRA), *filter(None, [env.get("PYTHONPATH")])])
    t = time.monotonic()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], sep="\n")
        raise SystemExit(f"{what} failed ({p.returncode}): {shlex.join(argv)}")
    dt = time.monotonic() - t
    log(f"{what} {dt:.0f} s")
    return dt


def bench_manifest(work: Path, train_dir: Path) -> dict[str, Any]:
    """The draft's manifest, its prompt source swapped for the held-out prompts (all held out)."""
    if (train_dir / "manifest.json").exists():
        man = json.loads((train_dir / "manifest.json").read_text())
        man["path"] = str((train_dir / man.get("path", "draft")).resolve())
    else:  # an external trainer's draft: what the bench needs from the store's manifest
        ext = json.loads((work / "ext" / "manifest.json").read_text())
        man = {
            "kind": "draft",
            "path": str((train_dir / "draft").resolve()),
            "target": MODEL,
            "aux_layer_ids": ext["aux_layer_ids"],
            "max_length": ext.get("max_length"),
        }
    man["token_sources"] = [str(work / "tokh")]
    man["holdout"] = 1.0
    return man
