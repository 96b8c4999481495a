"""The SGLang serving bench's shared choices: which target and work folder, the result keys, the training plan's
sections and the server settings (the serve stage's argv builder with the bench's backend flags). Its phases
(``sglang_serve``, ``sglang_ab``, ``sglang_stages``) and ``dflash`` read them from here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.gpu.runner import BASE
from pipeline.serving.sglang_args import ServerSettings, Speculative, eagle3_flags


def target_name(args: argparse.Namespace) -> str:
    return "llama8b_structured" if args.target == "structured" else "llama8b"


def work_dir(args: argparse.Namespace) -> Path:
    return BASE / ("work_structured" if args.target == "structured" else "work")


def plain_key(args: argparse.Namespace) -> str:
    return key(args, "plain")


def key(args: argparse.Namespace, what: str) -> str:
    """Result keys: the random target's as before, the structured one's prefixed."""
    return f"structured_{what}" if args.target == "structured" else what


def training_sections(args: argparse.Namespace) -> str:
    """The plan's [prep] … [train] tables the bench's training runs share (this phase and ``gpu_sglang_stages``)."""
    return f"""[prep]
reject_threshold = 0.5
[extract]
batch_tokens = 32768
shard_tokens = 1048576
eval_rows = 32
[vocab]
draft_vocab_size = 8192
[train]
steps = {args.steps}
batch_size = {args.batch}
micro_batch = {args.batch}
ttt_steps = {args.ttt}
lr = {args.lr}
checkpoint_every = {args.steps // 2}
keep_checkpoints = 1
log_every = 50
eval_spec_steps = 3
"""


def settings(
    model: Path,
    port: int,
    args: argparse.Namespace,
    draft: Path | None = None,
    spec: tuple[int, int, int] = (3, 1, 4),
    backend: str | None = None,
    more: tuple[str, ...] = (),
) -> ServerSettings:
    extra = [
        "--attention-backend",
        backend or args.attention_backend,
        "--sampling-backend",
        "pytorch",
        "--grammar-backend",
        "none",
        "--enable-metrics",
        "--cuda-graph-max-bs",
        str(max(args.batches)),
        "--log-level",
        "info",
    ]
    if args.no_cuda_graph:
        extra.append("--disable-cuda-graph")
    if args.no_prefill_graph:  # the piecewise prefill graphs cost 34-84 s a start; decode graphs stay
        extra += ["--cuda-graph-backend-prefill", "disabled"]
    extra += list(more)
    return ServerSettings(
        backend="sglang",
        model=str(model),
        host="127.0.0.1",
        port=port,
        tp=1,
        mem_fraction_static=args.mem_fraction,
        context_length=args.context_length,
        extra_args=tuple(extra),
        speculative=Speculative(str(draft), eagle3_flags(*spec)) if draft else None,
    )
