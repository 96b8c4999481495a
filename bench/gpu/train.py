"""Draft-training throughput on a GPU: tokens/s and MFU of one ``pipeline.stages.train`` step.

``python -m bench.gpu.train [--shape llama8b] [--configs 4x2048x7,2x4096x7,...] [--steps 8]``

The EAGLE-3 draft of a Llama-3.1-8B-shaped target (hidden 4096, 32000-token draft vocabulary) with
random weights, trained by the stage's own step (``pipeline.drafts.eagle3.loss.ttt_sums``: TTT unrolled, soft
labels from the target head, bf16 autocast over fp32 master weights, AdamW, grad clipping) on
synthetic offline batches (random features: throughput only). Each config is ``BATCHxSEQxTTT``.
MFU counts the useful FLOPs — draft linear layers and causal chain attention (x3 for forward and
backward) plus the target-head soft labels (forward only) — over the bf16 matmul ceiling measured
in the same run; ``attn_exec/useful`` says how much more attention the implementation executes: ~1 since
issue 15 (causal step-0 scores plus one sink key per query for the chain's diagonal scores, see
``draft_model.chain_attention``); the old concatenate-and-mask form executed 8x at TTT 7.
``--shape tiny --device cpu`` is a smoke run.

``--store`` (issue 15) also writes a real hidden-state store of the same shapes to local disk and trains
from it through the stage's data path — ``OfflineData`` on mapped shards, pinned batches, the ``Feeder``
thread with its copy stream — and, for comparison, with the rows read on the step's thread as before;
each printed as a share of the synthetic tokens/s (goal: ≥ 85 %). ``--baseline specforge`` times
SpecForge 0.2.0's draft forward+backward (``bench/gpu/specforge_peer.py``) on the same config and batch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu.common import (
    device_info,
    llama_config,
    matmul_ceiling_tflops,
    random_draft,
    sync,
    synthetic_batch,
    time_ms,
)
from bench.gpu.results import write_out
from pipeline.drafts.batch import Batch
from pipeline.drafts.eagle3.loss import ttt_sums
from pipeline.eagle3.draft_config import DraftConfig
from pipeline.eagle3.draft_model import Eagle3Draft


def flops(cfg: DraftConfig, seq: int, ttt: int) -> dict[str, float]:
    """Per-token FLOPs of one training step (forward x3 for the draft, x1 for the soft labels)."""
    h, nh, nkv, hd, inter, vd = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.draft_vocab_size,
    )
    linear = 2 * (2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter + h * vd)
    fc = 2 * 3 * h * h
    attn_useful = sum(4 * nh * hd * ((seq + 1) / 2 + j) for j in range(ttt))
    attn_exec = sum(
        4 * nh * hd * ((seq + 1) / 2 + 1 + j) for j in range(ttt)
    )  # + the sink key, + j diagonals
    soft = 2 * h * vd
    return {
        "useful": 3 * (ttt * linear + fc + attn_useful) + soft,
        "attn_useful": attn_useful,
        "attn_exec": attn_exec,
    }


def build(
    cfg: DraftConfig, dev: torch.device
) -> tuple[Eagle3Draft, torch.Tensor, torch.Tensor, list, torch.optim.Optimizer]:
    draft, ids = random_draft(cfg, dev)
    vd, h = cfg.draft_vocab_size, cfg.hidden_size
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    fdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head_d = (torch.randn(vd, h, device=dev) * h**-0.5).to(fdt)
    return draft, head_d, ids, params, opt


def step_fn(
    draft: Eagle3Draft,
    head_d: torch.Tensor,
    params: list,
    opt: torch.optim.Optimizer,
    ttt: int,
    dev: torch.device,
) -> Callable[[Batch], float]:
    """The stage's optimizer step on one batch; returns the real tokens it trained on (a host sync, as the stage's
    metrics are)."""

    def step(batch: Batch) -> float:
        counts = torch.stack([batch.step_mask(j).sum() for j in range(ttt)]).double().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        losses, _ = ttt_sums(draft, draft, batch, head_d, ttt, autocast=dev.type == "cuda")
        sum((0.8**j) * losses[j] / counts[j] for j in range(ttt)).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return float(batch.lengths.sum())

    return step


def run_config(cfg: DraftConfig, b: int, s: int, ttt: int, steps: int, dev: torch.device) -> dict:
    draft, head_d, ids, params, opt = build(cfg, dev)
    fdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batch = synthetic_batch(cfg, ids, b, s, dev, fdt)
    step = step_fn(draft, head_d, params, opt, ttt, dev)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ms = statistics.median(time_ms(lambda: step(batch), dev, warmup=2, reps=steps))
    f = flops(cfg, s, ttt)
    tok_s = b * s / (ms / 1e3)
    out = {
        "batch": b,
        "seq": s,
        "ttt": ttt,
        "step_ms": ms,
        "tok_s": tok_s,
        "useful_tflop_s": f["useful"] * tok_s / 1e12,
        "attn_exec_over_useful": f["attn_exec"] / f["attn_useful"],
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
    }
    return out


def write_store(
    root: Path, cfg: DraftConfig, rows: int, seq: int, draft_ids: torch.Tensor, rows_per_shard: int
) -> Path:
    """A real offline store (``hidden_store`` shards + manifest) of ``rows`` random rows of ``seq`` tokens."""
    from pipeline.eagle3 import hidden_store as hs
    from pipeline.run.rundir.layout import write_json

    h, g = cfg.hidden_size, torch.Generator().manual_seed(0)
    shards = []
    for si, a in enumerate(range(0, rows, rows_per_shard)):
        chunk = []
        for _ in range(min(rows_per_shard, rows - a)):
            chunk.append(
                {
                    "aux": torch.randn(seq, 3 * h, generator=g).to(torch.bfloat16),
                    "last_hidden": torch.randn(seq, h, generator=g).to(torch.bfloat16),
                    "target_argmax": draft_ids[torch.randint(0, len(draft_ids), (seq,), generator=g)],
                    "input_ids": torch.randint(0, cfg.vocab_size, (seq,), generator=g),
                    "loss_mask": torch.ones(seq, dtype=torch.int8),
                }
            )
        name = hs.shard_name(si)
        size = hs.write_shard(root / name, chunk, [f"r{a + k}" for k in range(len(chunk))])
        shards.append({"file": name, "rows": len(chunk), "tokens": len(chunk) * seq, "bytes": size})
    write_json(
        root / "manifest.json",
        {
            "kind": hs.KIND,
            "format": hs.FORMAT,
            "mode": "offline",
            "aux_layer_ids": [1, 2, 3],
            "rows": rows,
            "shards": shards,
            "eval_shards": [],
        },
    )
    return root


def run_store(
    cfg: DraftConfig, b: int, s: int, ttt: int, steps: int, dev: torch.device, store_dir: Path, prefetch: int
) -> dict:
    """The stage's data path: rows read from a real store on disk by ``OfflineData`` (through the ``Feeder`` thread
    when ``prefetch`` > 0, else on the step's thread as before issue 15), same shapes as the synthetic run."""
    from pipeline.eagle3 import hidden_store as hs
    from pipeline.stages.train.batches import OfflineData
    from pipeline.stages.train.feeder import Feeder, Inline
    from pipeline.stages.train.settings import BatchSchedule

    draft, head_d, _, params, opt = build(cfg, dev)
    step = step_fn(draft, head_d, params, opt, ttt, dev)
    data = OfflineData(hs.HiddenStore(store_dir))
    sched = BatchSchedule(len(data), b, 0, [data.length(i) for i in range(len(data))], 16)
    fdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    total = steps + 2
    chunks = lambda k: [sched.rows(k)]  # noqa: E731 - one micro-batch per step, as the synthetic run
    feeder = (
        Feeder(data, range(1, total + 1), chunks, dev, fdt, prefetch)
        if prefetch
        else Inline(data, chunks, dev, fdt)
    )
    try:
        for k in (1, 2):  # warm-up, as the synthetic run
            step(feeder.next(k)[0])
        sync(dev)
        t0, tokens, per_step = time.perf_counter(), 0.0, []
        for k in range(3, total + 1):
            t = time.perf_counter()
            tokens += step(feeder.next(k)[0])
            per_step.append((time.perf_counter() - t) * 1e3)
        sync(dev)
        wall = time.perf_counter() - t0
    finally:
        feeder.close()
    return {
        "batch": b,
        "seq": s,
        "ttt": ttt,
        "tok_s": tokens / wall,
        "step_ms": statistics.median(per_step),
        "step_ms_max": max(per_step),
        "prefetch": prefetch,
    }


def check_against_cpu(
    cfg: DraftConfig, dev: torch.device, seq: int = 256, ttt: int = 3
) -> dict[str, list[float]]:
    """TTT logits on the device (fp32, and bf16 autocast as trained) vs a float64 CPU reference."""
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        p.data.normal_(0, 0.02)
    aux = torch.randn(1, seq, 3 * cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    lengths = torch.tensor([seq])
    with torch.no_grad():
        ref = [x.double() for x in draft.double()(aux.double(), ids, lengths, ttt)]
        d = draft.float().to(dev)
        a, i, n = aux.to(dev), ids.to(dev), lengths.to(dev)
        fp32 = d(a, i, n, ttt)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            bf16 = d(a, i, n, ttt)

    def rel(xs: list[torch.Tensor]) -> list[float]:
        return [float((x.double().cpu() - r).norm() / r.norm()) for x, r in zip(xs, ref, strict=True)]

    return {"fp32_rel_err": rel(fp32), "bf16_rel_err": rel(bf16)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--configs", default="2x2048x7,4x2048x7,2x4096x7,4x2048x1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--store",
        action="store_true",
        help="also train each config from a real store on disk through the stage's data path "
        "(the feeder thread, and the old on-the-step-thread read), next to the synthetic step",
    )
    ap.add_argument(
        "--baseline",
        choices=["specforge"],
        default=None,
        help="also time SpecForge's draft forward+backward on the same config, batch and sequence length",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="with --baseline: print each side's top ROWS operators by device time",
    )
    return ap.parse_args()


def measure_config(
    args: argparse.Namespace, cfg: DraftConfig, spec: str, dev: torch.device, ceiling: float
) -> dict:
    """One ``BxSxT`` config: the synthetic step, then (``--store``) the stage's data path and (``--baseline``)
    SpecForge's draft on the same shapes."""
    b, s, t = (int(x) for x in spec.split("x"))
    try:
        r = run_config(cfg, b, s, t, args.steps, dev)
        r["mfu"] = r["useful_tflop_s"] / ceiling
    except torch.OutOfMemoryError:
        r = {"batch": b, "seq": s, "ttt": t, "error": "out of memory"}
        torch.cuda.empty_cache()
    if args.store and "error" not in r:
        with tempfile.TemporaryDirectory(prefix="aerie-bench-store-") as d:
            write_store(
                Path(d),
                cfg,
                b * (args.steps + 2),
                s,
                torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values.to(torch.int32),
                rows_per_shard=max(1, b),
            )
            for prefetch in (2, 0):
                rs = run_store(cfg, b, s, t, args.steps, dev, Path(d), prefetch)
                r[f"store_prefetch{prefetch}_tok_s"] = rs["tok_s"]
                r[f"store_prefetch{prefetch}_step_ms_max"] = rs["step_ms_max"]
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    if args.baseline == "specforge" and "error" not in r:
        from bench.gpu.specforge_peer import time_specforge_vs_aerie

        r["specforge"] = time_specforge_vs_aerie(
            dev, cfg, b, s, t, reps=args.steps, profile_rows=args.profile
        )
        for side in ("aerie", "specforge") if args.profile else ():
            print(f"--- {side}, {b}x{s}x{t}: top operators by device time (two steps)")
            print(r["specforge"].pop(f"{side}_profile"))
    return r


def main() -> int:
    args = parse_args()
    dev = torch.device(args.device)
    ceiling = matmul_ceiling_tflops(dev)
    tcfg = llama_config(args.shape, 32)
    cfg = DraftConfig.from_target(tcfg, min(args.draft_vocab, tcfg.vocab_size), [1, 15, 28])
    check = check_against_cpu(cfg, dev)
    if any(e > 1e-4 for e in check["fp32_rel_err"]) or any(e > 3e-2 for e in check["bf16_rel_err"]):
        print(f"CHECK FAILED: {check}")
        return 1
    rows = []
    for spec in args.configs.split(","):
        rows.append(measure_config(args, cfg, spec, dev, ceiling))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res = {
        "bench": "gpu_train",
        **device_info(dev),
        "shape": args.shape,
        "draft_vocab": cfg.draft_vocab_size,
        "draft_params_m": sum(p.numel() for p in Eagle3Draft(cfg).parameters() if p.requires_grad) / 1e6,
        "matmul_ceiling_tflops": ceiling,
        "check": check,
        "configs": rows,
    }
    write_out("gpu_train.json", res)
    print_summary(res, args, cfg, dev)
    return 0


def print_summary(res: dict, args: argparse.Namespace, cfg: DraftConfig, dev: torch.device) -> None:
    ceiling, check, rows = res["matmul_ceiling_tflops"], res["check"], res["configs"]
    print(
        f"\ngpu_train on {res.get('name', dev)}: {args.shape} draft, {res['draft_params_m']:.0f}M trainable, "
        f"draft vocab {cfg.draft_vocab_size}; bf16 matmul ceiling {ceiling:.1f} TFLOP/s"
    )
    print(
        "  TTT logits vs float64 CPU, relative error per step: fp32 "
        + " ".join(f"{e:.1e}" for e in check["fp32_rel_err"])
        + "; bf16 autocast "
        + " ".join(f"{e:.1e}" for e in check["bf16_rel_err"])
    )
    print(
        f"  {'batch x seq x ttt':>18} {'step ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'attn x':>7} {'GiB':>6}"
    )
    for r in rows:
        name = f"{r['batch']}x{r['seq']}x{r['ttt']}"
        if "error" in r:
            print(f"  {name:>18} {r['error']}")
            continue
        print(
            f"  {name:>18} {r['step_ms']:9.1f} {r['tok_s']:9,.0f} {r['useful_tflop_s']:8.1f} {r['mfu']:6.1%} "
            f"{r['attn_exec_over_useful']:7.1f} {r['peak_mem_gib'] or 0:6.1f}"
        )
        if "store_prefetch2_tok_s" in r:
            for pf, what in ((2, "feeder thread (the stage)"), (0, "read on the step's thread (before)")):
                v = r[f"store_prefetch{pf}_tok_s"]
                print(
                    f"  {'':>18} real store, {what}: {v:,.0f} tok/s = {v / r['tok_s']:.1%} of synthetic "
                    f"(slowest step {r[f'store_prefetch{pf}_step_ms_max']:.0f} ms)"
                )
        if "specforge" in r:
            sf = r["specforge"]
            print(
                f"  {'':>18} {sf['batch']}x{sf['seq_len']}x{sf['ttt']} fwd+bwd, SpecForge 0.2.0 draft: "
                f"{sf['specforge_tokens_per_s']:,.0f} tok/s, Aerie "
                f"{sf['aerie_tokens_per_s']:,.0f} tok/s: Aerie/SpecForge = {sf['ratio']:.2f}x"
            )


if __name__ == "__main__":
    raise SystemExit(main())
