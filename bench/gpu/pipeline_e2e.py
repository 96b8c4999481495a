"""The EAGLE-3 stages end to end on a GPU, through their real command lines.

``python -m bench.gpu.pipeline_e2e [--shape llama8b] [--layers 4] [--rows 64] [--seq 1024] [--steps 40]``

Builds a Llama-3.1-8B-shaped target with ``--layers`` layers and random bf16 weights in a local
folder, a tokenized dataset of random tokens in the prep contract (Parquet + manifest), then runs
``pipeline.stages.extract`` → ``pipeline.stages.vocab`` → ``pipeline.stages.train`` (under ``torchrun``, one process per
GPU: ``--nproc``) → ``pipeline.stages.bench`` (offline acceptance, lossless check on) as subprocesses, and
reports each stage's wall time and the throughput its own events recorded. Random weights and data:
this proves the GPU path (bf16, CUDA, checkpoints, torchrun) and measures speed, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.gpu.common import llama_config
from bench.gpu.results import stage_messages, stage_metrics, write_out
from bench.gpu.runner import ROOT
from pipeline.run.rundir.protocol import Metric


def make_model(path: Path, shape: str, layers: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape, layers)
    cfg.eos_token_id = 2
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(path))


def make_data(path: Path, rows: int, seq: int, vocab: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    path.mkdir(parents=True, exist_ok=True)
    shards = []
    per = 16
    for si in range(0, rows, per):
        n = min(per, rows - si)
        ids = [rng.integers(3, vocab, seq).astype(np.int32).tolist() for _ in range(n)]
        prompt = 64
        masks = [[0] * prompt + [1] * (seq - prompt) for _ in range(n)]
        t = pa.table(
            {
                "id": pa.array([f"r{si + i}" for i in range(n)]),
                "input_ids": pa.array(ids, pa.list_(pa.int32())),
                "loss_mask": pa.array(masks, pa.list_(pa.int8())),
                "num_tokens": pa.array([seq] * n, pa.int32()),
            }
        )
        name = f"data-{si // per:05d}.parquet"
        pq.write_table(t, path / name)
        shards.append({"file": name, "rows": n, "tokens": n * seq})
    (path / "manifest.json").write_text(
        json.dumps({"kind": "tokenized", "rows": rows, "tokens": rows * seq, "shards": shards})
    )


def stage(module: str, plan: Path, out: Path, inputs: list[Path], torchrun: int = 0) -> float:
    argv = ["-m", module, "--plan", str(plan), "--out", str(out)]
    for i in inputs:
        argv += ["--input", str(i)]
    if torchrun:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}", *argv]
    t = time.monotonic()
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    dt = time.monotonic() - t
    if p.returncode != 0:
        print(p.stderr[-3000:])
        raise SystemExit(f"{module} failed ({p.returncode})")
    return dt


def metric(out: Path, name: str) -> list[Metric]:
    return stage_metrics(out, name)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--work", default="/tmp/gpu_pipeline")
    return ap.parse_args()


def plan_text(args: argparse.Namespace, work: Path) -> str:
    """The run's plan: extract, vocab, train (``--nproc`` ranks) and a lossless-checked bench."""
    return f"""[run]
name = "gpu"
dir = "{work / "run"}"
[target]
model = "{work / "model"}"
max_length = {args.seq}
[extract]
batch_tokens = 16384
shard_tokens = 65536
[vocab]
draft_vocab_size = 32000
[train]
steps = {args.steps}
batch_size = {8 * args.nproc}
micro_batch = 4
ttt_steps = 7
lr = 0.0001
checkpoint_every = {max(1, args.steps // 2)}
log_every = 1
[bench]
holdout = 0.1
prompts = 4
max_new_tokens = 64
steps = 3
check_lossless = true
"""


def main() -> int:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    make_model(work / "model", args.shape, args.layers)
    t_model = time.monotonic() - t0
    vocab = llama_config(args.shape, 1).vocab_size
    make_data(work / "tok", args.rows, args.seq, vocab)
    plan = work / "plan.toml"
    plan.write_text(plan_text(args, work))
    times = {"model_build_s": t_model}
    times["extract_s"] = stage("pipeline.stages.extract", plan, work / "ext", [work / "tok"])
    times["vocab_s"] = stage("pipeline.stages.vocab", plan, work / "voc", [work / "tok"])
    times["train_s"] = stage(
        "pipeline.stages.train", plan, work / "train", [work / "ext", work / "voc"], torchrun=args.nproc
    )
    times["bench_s"] = stage("pipeline.stages.bench", plan, work / "bench", [work / "train"])
    ext_tps = [e.value for e in metric(work / "ext", "tokens_per_s") if e.data.get("overall")]
    train_tps = sorted(e.value for e in metric(work / "train", "tokens_per_s"))
    man = json.loads((work / "ext" / "manifest.json").read_text())
    bench = json.loads((work / "bench" / "results.json").read_text())
    msgs = [e.text for e in stage_messages(work / "bench")]
    res = {
        "bench": "gpu_pipeline",
        "shape": args.shape,
        "layers": args.layers,
        "rows": args.rows,
        "seq": args.seq,
        "nproc": args.nproc,
        **times,
        "extract_tok_s": ext_tps[-1] if ext_tps else None,
        "extract_bytes": man["bytes"],
        "extract_tokens": man["tokens"],
        "train_tok_s_median": train_tps[len(train_tps) // 2] if train_tps else None,
        "train_loss_first_last": [
            metric(work / "train", "loss")[0]["value"],
            metric(work / "train", "loss")[-1]["value"],
        ],
        "accept_len": bench["accept_len"],
        "verify_steps": bench["verify_steps"],
        "lossless_warnings": [m for m in msgs if "differs" in m],
        "checkpoints": sorted(p.name for p in (work / "train" / "checkpoints").iterdir()),
        "draft_files": sorted(p.name for p in (work / "train" / "draft").iterdir()),
    }
    write_out("gpu_pipeline.json", res)
    print_summary(res, args)
    os.sync()
    return 0


def print_summary(res: dict, args: argparse.Namespace) -> None:
    print(
        f"\ngpu_pipeline: {args.shape} x{args.layers} layers, {args.rows} rows x {args.seq} tokens, torchrun x{args.nproc}"
    )
    for k in ("model_build_s", "extract_s", "vocab_s", "train_s", "bench_s"):
        print(f"  {k:<14} {res[k]:7.1f} s")
    print(
        f"  extract {res['extract_tok_s'] or 0:,.0f} tok/s ({res['extract_bytes'] / 1e9:.2f} GB for {res['extract_tokens']:,} tokens); "
        f"train {res['train_tok_s_median'] or 0:,.0f} tok/s (median step); loss {res['train_loss_first_last']}"
    )
    print(
        f"  bench accept_len {res['accept_len']:.2f} over {res['verify_steps']} verify steps; "
        f"lossless warnings: {len(res['lossless_warnings'])}; checkpoints {res['checkpoints']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
