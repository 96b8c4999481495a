"""Online-TP training vs offline extract + train, on one GPU (TP = 1), through the real stages.

``python -m bench.gpu.online [--shape llama8b] [--layers 8] [--rows 128] [--seq 1024] [--steps 30]``

The same Llama-3.1-8B-shaped random bf16 target and random tokenized rows (``bench/gpu/pipeline_e2e.py``'s
builders) trained two ways: **offline** (``pipeline.stages.extract`` stores the hidden states, then
``pipeline.stages.train`` reads them) and **online-TP** (``[train] target = "online-tp"``: the train stage
runs the target, tensor-parallel over its ranks — here 1 — and captures each step's global batch).
Prints wall time per stage, training tokens/s (the stage's own median), peak GPU memory of each
training (``peak_memory_gib``), the bytes stored, and the projection for the reference run
(100K rows, ``--ref-tokens`` tokens per row on average, ``--epochs`` epochs): disk and wall time per
mode. One GPU is not 8-way TP: the projection scales the measured rates linearly to 8 GPUs and says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gpu.common import llama_config
from bench.gpu.pipeline_e2e import make_data, make_model, metric, stage
from bench.gpu.results import write_out


def plan_text(work: Path, args: argparse.Namespace, online: bool) -> str:
    return f"""[run]
name = "gpu-online"
dir = "{work / "run"}"
[target]
model = "{work / "model"}"
max_length = {args.seq}
[extract]
batch_tokens = 16384
shard_tokens = 65536
{'mode = "online"' if online else ""}
[vocab]
draft_vocab_size = 32000
[train]
steps = {args.steps}
batch_size = 8
micro_batch = 4
ttt_steps = 7
lr = 0.0001
checkpoint_every = {args.steps}
log_every = 1
{'target = "online-tp"' if online else ""}
"""


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ref-rows", type=int, default=100_000)
    ap.add_argument("--ref-tokens", type=int, default=1_500, help="mean tokens per reference row")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--work", default="/tmp/gpu_online")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    make_model(work / "model", args.shape, args.layers)
    make_data(work / "tok", args.rows, args.seq, llama_config(args.shape, 1).vocab_size)
    off, on = work / "offline.toml", work / "online.toml"
    off.write_text(plan_text(work, args, online=False))
    on.write_text(plan_text(work, args, online=True))
    t = {"vocab_s": stage("pipeline.stages.vocab", off, work / "voc", [work / "tok"])}
    t["offline_extract_s"] = stage("pipeline.stages.extract", off, work / "ext-off", [work / "tok"])
    t["offline_train_s"] = stage(
        "pipeline.stages.train", off, work / "train-off", [work / "ext-off", work / "voc"]
    )
    t["online_extract_s"] = stage("pipeline.stages.extract", on, work / "ext-on", [work / "tok"])
    t["online_train_s"] = stage(
        "pipeline.stages.train", on, work / "train-on", [work / "ext-on", work / "voc"]
    )
    ext = json.loads((work / "ext-off" / "manifest.json").read_text())
    res: dict = {
        "bench": "gpu_online",
        "shape": args.shape,
        "layers": args.layers,
        "rows": args.rows,
        "seq": args.seq,
        "steps": args.steps,
        **t,
        "offline_bytes": ext["bytes"],
        "offline_tokens": ext["tokens"],
        "online_bytes": json.loads((work / "ext-on" / "manifest.json").read_text())["bytes"],
    }
    ext_tps = [e["value"] for e in metric(work / "ext-off", "tokens_per_s") if e.get("overall")]
    res["extract_tok_s"] = ext_tps[-1] if ext_tps else None
    for mode in ("off", "on"):
        d = work / f"train-{mode}"
        res[f"train_{mode}_tok_s"] = median([e["value"] for e in metric(d, "tokens_per_s")][1:])
        peak = metric(d, "peak_memory_gib")
        res[f"train_{mode}_peak_gib"] = peak[-1]["value"] if peak else None
    res["projection"] = projection(args, res, ext)
    write_out("gpu_online.json", res)
    print_summary(res, args, t, ext)
    return 0


def projection(args: argparse.Namespace, res: dict, ext: dict) -> dict:
    """The reference run's disk and hours, offline vs online, from this GPU's measured rates."""
    # The reference run: tokens per epoch, on 8 GPUs (rates scaled linearly from this one GPU: not measured)
    ref_tokens = args.ref_rows * args.ref_tokens
    bpt = ext["bytes"] / max(1, ext["tokens"])
    gpus = 8
    extract_h = ref_tokens / max(1.0, res["extract_tok_s"] or 1.0) / gpus / 3600
    off_train_h = ref_tokens * args.epochs / max(1.0, res["train_off_tok_s"]) / gpus / 3600
    on_train_h = ref_tokens * args.epochs / max(1.0, res["train_on_tok_s"]) / gpus / 3600
    return {
        "ref_tokens": ref_tokens,
        "epochs": args.epochs,
        "gpus": gpus,
        "bytes_per_token_this_shape": bpt,
        "offline_disk_bytes": ref_tokens * bpt,
        "online_disk_bytes": 0,
        "offline_hours": extract_h + off_train_h,
        "online_hours": on_train_h,
    }


def print_summary(res: dict, args: argparse.Namespace, t: dict, ext: dict) -> None:
    gpus = res["projection"]["gpus"]
    print(
        f"\ngpu_online: {args.shape} x{args.layers} layers, {args.rows} rows x {args.seq} tokens, {args.steps} steps"
    )
    print(
        f"  offline: extract {t['offline_extract_s']:.1f} s ({res['extract_tok_s'] or 0:,.0f} tok/s, "
        f"{ext['bytes'] / 1e9:.2f} GB stored) + train {t['offline_train_s']:.1f} s "
        f"({res['train_off_tok_s']:,.0f} tok/s, peak {res['train_off_peak_gib'] or 0:.1f} GiB)"
    )
    print(
        f"  online-tp: train {t['online_train_s']:.1f} s ({res['train_on_tok_s']:,.0f} tok/s, "
        f"peak {res['train_on_peak_gib'] or 0:.1f} GiB), 0 B stored"
    )
    pr = res["projection"]
    print(
        f"  reference run ({args.ref_rows:,} rows x {args.ref_tokens} tokens, {args.epochs} epoch(s), rates x{gpus} GPUs, "
        f"this shape): offline {pr['offline_disk_bytes'] / 1e12:.2f} TB, {pr['offline_hours']:.1f} h; "
        f"online-tp 0 TB, {pr['online_hours']:.1f} h"
    )


if __name__ == "__main__":
    raise SystemExit(main())
