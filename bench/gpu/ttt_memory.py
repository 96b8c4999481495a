"""Peak memory and time of one draft-training forward+backward: the old TTT form against the new (issue 15).

``python -m bench.gpu.ttt_memory [--device cpu|cuda] [--shape tiny|llama8b] [--batch 2] [--seq 512] [--ttt 7]
[--draft-vocab 8192] [--chunk 4096] [--reps 3]``

Variants, each in a fresh process (so one's peak cannot hide another's):

- ``old``: the full ``(S, (1+j)·S)`` chain mask (``chain_attention_reference``) and the unchunked loss
  (``ttt_sums_unchunked``: every step's (tokens × draft vocab) fp32 logits alive until backward);
- ``attn``: the sink-key chain attention, unchunked loss;
- ``new``: sink-key attention and the loss chunked over ``--chunk`` tokens (what training runs).

Peak memory is ``torch.cuda.max_memory_allocated`` over the step on CUDA; on CPU it is the process's
resident set sampled every 0.5 ms during the step, minus the RSS before it (torch's CPU allocator is
invisible to tracemalloc) — the report names which. Random weights and features: memory/time only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from bench.gpu.common import SHAPES, random_draft, sync, synthetic_batch, time_ms
from bench.gpu.runner import ROOT
from pipeline.drafts.eagle3.loss import ttt_sums, ttt_sums_unchunked
from pipeline.eagle3 import draft_model as dm
from pipeline.eagle3.draft_config import DraftConfig

VARIANTS = ("old", "attn", "new")


def draft_config(shape: str, draft_vocab: int) -> DraftConfig:
    s = SHAPES[shape]
    return DraftConfig(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
        vocab_size=max(s["vocab_size"], draft_vocab),
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=s["hidden_size"],
        rope_theta=s["rope_theta"],
        max_position_embeddings=max(s["max_position_embeddings"], 8192),
    )


def _old_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    q_cols: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    chain: list | None = None,
    causal: bool = False,
) -> torch.Tensor:
    return dm.chain_attention_reference(q, k0, v0, q_cols, key_valid, chain)


class RssPeak:
    """Samples this process's resident set in a thread; ``peak`` is the highest seen, in bytes."""

    def __init__(self, every_s: float = 0.0005) -> None:
        import os

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.every = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def __enter__(self) -> RssPeak:
        self.peak = self.rss()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    cfg = draft_config(args.shape, args.draft_vocab)
    draft, ids = random_draft(cfg, dev)
    vd, h = cfg.draft_vocab_size, cfg.hidden_size
    autocast = dev.type == "cuda"
    fdt = torch.bfloat16 if autocast else torch.float32
    b, s, ttt = args.batch, args.seq, args.ttt
    head_d = (torch.randn(vd, h, device=dev) * h**-0.5).to(fdt)
    batch = synthetic_batch(cfg, ids, b, s, dev, fdt)
    counts = [max(float(batch.step_mask(j).sum()), 1.0) for j in range(ttt)]
    if variant == "old":
        dm.chain_attention = _old_attention  # type: ignore[assignment]  # this process only
    chunk = args.chunk if variant == "new" else 0

    def step() -> None:
        draft.zero_grad(set_to_none=True)
        if chunk:
            losses, _ = ttt_sums(draft, draft, batch, head_d, ttt, autocast, chunk_tokens=chunk)
        else:
            losses, _ = ttt_sums_unchunked(draft, draft, batch, head_d, ttt, autocast)
        sum((0.8**j) * losses[j] / counts[j] for j in range(ttt)).backward()

    step()  # warm-up: kernels, allocator pools, gradient buffers
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        step()
        sync(dev)
        peak, how = (
            torch.cuda.max_memory_allocated(dev) - before,
            "torch.cuda.max_memory_allocated over the step",
        )
    else:
        with RssPeak() as r:
            before = r.rss()
            step()
        peak, how = r.peak - before, "sampled process RSS during the step, minus RSS before it"
    ms = statistics.median(time_ms(step, dev, warmup=0, reps=args.reps))
    return {
        "variant": variant,
        "peak_mib": round(peak / 2**20, 1),
        "memory": how,
        "step_ms": round(ms, 2),
        "tokens_per_s": round(b * s / (ms / 1e3)),
        "batch": b,
        "seq": s,
        "ttt": ttt,
        "draft_vocab": vd,
        "hidden": h,
        "chunk": chunk,
        "device": str(dev),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return 0
    rows = []
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    for variant in args.variants.split(","):
        p = subprocess.run(
            [sys.executable, "-m", "bench.gpu.ttt_memory", *base, "--child", variant],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"variant": variant, "error": tail})
            continue
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    ok = [r for r in rows if "error" not in r]
    if ok:
        r0 = ok[0]
        print(
            f"{r0['device']}: batch {r0['batch']} x seq {r0['seq']}, TTT {r0['ttt']}, hidden {r0['hidden']}, "
            f"draft vocab {r0['draft_vocab']}; memory = {r0['memory']}"
        )
    print(f"{'variant':>8} {'peak MiB':>10} {'step ms':>10} {'tokens/s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:>8}  error: {r['error']}")
        else:
            print(f"{r['variant']:>8} {r['peak_mib']:>10.1f} {r['step_ms']:>10.1f} {r['tokens_per_s']:>10,}")
    from bench.gpu.results import write_out

    write_out("ttt_memory.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
